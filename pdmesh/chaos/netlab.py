"""A network lab on one machine: hosts as Linux network namespaces, each joined to this
(the root) namespace by a veth pair, whose link can be cut, healed and shaped on cue.
Root only (`ip netns`, `nft`, `tc`). Traffic never leaves the machine.

    lab = NetLab()                         # reason() says why not, where it cannot run
    b = lab.host("b")                      # 10.77.<i>.2 inside, 10.77.<i>.1 on this side
    proc = subprocess.Popen(b.command(["python", "-m", "services.decode", ...]))
    b.cut()                                # every packet either way dropped: a partition
    b.heal()
    b.shape(loss_pct=1, rate="1gbit")      # delay_ms too, where the kernel has sch_netem
    lab.close()                            # namespaces, links and their processes gone

A host is more than an address: its commands run with their own hostname and their own
/dev/shm (a private mount), so a service there is on "another machine" to the others (KV
over shared memory, which needs the same /dev/shm, is not taken across the link).
"""
from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.77"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def reason() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nft", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"pdmprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"`ip netns add` fails here: {getattr(e, 'stderr', e)}".strip()
    return None


def netem_reason() -> str | None:
    """Why `tc netem` (link delay) is not available, or None."""
    probe = f"pdmnetem{os.getpid()}"
    try:
        _run("ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p")
    except (OSError, subprocess.CalledProcessError) as e:
        return f"no veth link: {getattr(e, 'stderr', e)}".strip()
    try:
        _run("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms")
        return None
    except subprocess.CalledProcessError as e:
        return f"this kernel has no sch_netem ({e.stderr.strip()})"
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


class Host:
    """One namespace; `outer` is its veth end on this side, `inner` the end inside."""

    def __init__(self, lab: "NetLab", name: str, index: int):
        self.name, self.index = name, index
        tag = f"{lab.tag}{index}"
        self.ns = f"pdm{tag}{name}"[:32]
        self.outer, self.inner = f"pdo{tag}"[:15], f"pdi{tag}"[:15]
        self.addr = f"{SUBNET}.{index}.2"          # the host's address
        self.peer = f"{SUBNET}.{index}.1"          # this side's address, as the host sees it
        self.hostname = f"pdmesh-{name}"
        _run("ip", "netns", "add", self.ns)
        try:
            _run("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _run("ip", "link", "set", self.inner, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.peer}/24", "dev", self.outer)
            _run("ip", "link", "set", self.outer, "up")
            for argv in (("ip", "addr", "add", f"{self.addr}/24", "dev", self.inner),
                         ("ip", "link", "set", self.inner, "up"),
                         ("ip", "link", "set", "lo", "up")):
                _run("ip", "netns", "exec", self.ns, *argv)
        except BaseException:
            self.close()
            raise

    def command(self, argv: list[str]) -> list[str]:
        """argv run on this host: its network, its hostname, its own /dev/shm."""
        script = (f'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname {self.hostname} '
                  '&& exec "$@"')
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-c", script, "sh", *argv]

    # ---- the link --------------------------------------------------------------------
    # Loss and cuts are nftables rules in the host's namespace (every packet to or from
    # it crosses them); the rate is a token bucket (tc tbf) on both veth ends. Delay
    # needs sch_netem, which not every kernel has (netem_reason()).
    def _in(self, *argv: str) -> None:
        _run("ip", "netns", "exec", self.ns, *argv)

    def _rules(self, verdict: str) -> None:
        """Replace the host's link rules with `verdict` on every non-loopback packet."""
        subprocess.run(["ip", "netns", "exec", self.ns, "nft", "delete", "table", "inet",
                        "pdmlab"], capture_output=True)
        if not verdict:
            return
        self._in("nft", "add", "table", "inet", "pdmlab")
        for chain, dev in (("input", "iifname"), ("output", "oifname")):
            self._in("nft", "add", "chain", "inet", "pdmlab", chain,
                     f"{{ type filter hook {chain} priority 0 ; }}")
            self._in("nft", "add", "rule", "inet", "pdmlab", chain, dev, "!=", "lo",
                     *verdict.split())

    def cut(self) -> None:
        """A partition: every packet either way is dropped; no endpoint is told (no RST,
        no link-down), as when a switch port or a route fails."""
        self._rules("drop")

    def shape(self, loss_pct: float = 0, rate: str = "", delay_ms: float = 0) -> None:
        """Each direction: loss_pct of packets lost at random, rate ("1gbit") the link's
        bandwidth, delay_ms one way (sch_netem only)."""
        self.heal()
        if loss_pct:
            self._rules(f"numgen random mod 10000 < {int(loss_pct * 100)} drop")
        if delay_ms:
            why = netem_reason()
            if why:
                raise RuntimeError(f"no link delay here: {why}")
            self._qdisc("netem", "delay", f"{delay_ms}ms", *(("rate", rate) if rate else ()))
        elif rate:
            self._qdisc("tbf", "rate", rate, "burst", "1mbit", "latency", "100ms")

    def _qdisc(self, *params: str) -> None:
        """The same root qdisc on both veth ends (each direction of the link)."""
        _run("tc", "qdisc", "replace", "dev", self.outer, "root", *params)
        self._in("tc", "qdisc", "replace", "dev", self.inner, "root", *params)

    def heal(self) -> None:
        """The link as it was: no rule, no shaping."""
        self._rules("")
        for argv in (("tc", "qdisc", "del", "dev", self.outer, "root"),
                     ("ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.inner,
                      "root")):
            subprocess.run(argv, capture_output=True)     # none set: nothing to remove

    def close(self) -> None:
        """Kill what still runs in the namespace, then remove it (and its veth pair)."""
        pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class PortCut:
    """A process on this host cut off by its TCP ports (e.g. one nats-server of a cluster:
    its client and route ports): every packet to or from them dropped, loopback and veth
    traffic alike (nftables in this namespace)."""

    def __init__(self, ports: list[int], name: str = ""):
        self.ports = ports
        self.table = f"pdmcut{os.getpid()}{name}"[:30]

    def cut(self) -> None:
        self.heal()
        ports = "{ " + ", ".join(str(p) for p in self.ports) + " }"
        _run("nft", "add", "table", "inet", self.table)
        for chain in ("input", "output"):
            _run("nft", "add", "chain", "inet", self.table, chain,
                 f"{{ type filter hook {chain} priority 0 ; }}")
            for way in ("dport", "sport"):
                _run("nft", "add", "rule", "inet", self.table, chain, "tcp", way, ports, "drop")

    def heal(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)


class NetLab:
    def __init__(self):
        self.tag = f"{os.getpid() % 10000}"
        self.hosts: list[Host] = []

    def host(self, name: str) -> Host:
        h = Host(self, name, len(self.hosts) + 1 + (os.getpid() % 50) * 4)
        self.hosts.append(h)
        return h

    def close(self) -> None:
        for h in self.hosts:
            h.close()
        self.hosts.clear()

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
