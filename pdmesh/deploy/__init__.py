"""Deployment pieces shared by `pdmesh up` and compose: nats-server configs, NATS identities
and credentials, the job stream's keeper, the containers' health check."""
