"""The local mesh: `pdmesh up` / `serve` and their flags, the supervisor (children, restarts,
rolling restarts, readiness, the run record), and `launched`, which drives `pdmesh up` from
outside as a user would."""
