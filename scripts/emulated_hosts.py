"""Several hosts on one machine, to run and test what crosses a network: each host a network namespace with its own
host name, address, /etc/hosts and (optionally) its own disk at one path, the hosts joined by a bridge; OpenMPI starts
its daemons on them through a launch agent that enters a host's namespaces where ssh would log in.

    python scripts/emulated_hosts.py --hosts 2 -- mpirun -H node1:1,node2:1 -np 2 python Math.py --max_steps 6

runs the command on node1 (the head host, where mpirun starts), with the MCA settings of a cluster without ssh
(docs/multinode.md) in its environment. Needs root, iproute2 (`ip netns`) and util-linux (`unshare`).

What a host sees:
- the network: its own loopback and one interface (eth0, 10.231.0.<i>/24) on the bridge; every host's name in
  /etc/hosts; its host name (`hostname`) is its own, as a real node's;
- the disk: the machine's, except `disk` (optional), a folder that each host sees holding its own files (a bind
  mount of <disk>.<host>/ at <disk>): a run's --output_dir there is on each host's own disk;
- the home folder: this machine's, so a host finds Jittor prepared (its cache is keyed by the CPU, not the host
  name: Utils/jittor_env.py), as nodes sharing a home do; one named in `cold` has an empty home of its own
  instead, as a new node with its own disk has.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

SUBNET = "10.231.0"


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=check, capture_output=True, text=True)


def usable() -> str:
    """'' where hosts can be emulated here, else why not (one line)."""
    if os.geteuid() != 0:
        return "emulating hosts needs root (network namespaces, bind mounts)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulating hosts needs `{tool}` (iproute2, util-linux)"
    probe = f"moaprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    run("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    return ""


class Hosts:
    """`with Hosts(["node1", "node2"], disk=...) as hosts:` makes them, `hosts.popen(host, command)` starts a
    command there, and leaving the block stops every process left in them and removes them (namespaces, /etc/netns
    entries, the disk folders stay for the caller)."""

    def __init__(self, names, disk=None, cold=()):
        self.names, self.disk, self.cold = list(names), disk, set(cold)
        self.prefix = f"moa{os.getpid()}"
        self.folder = tempfile.mkdtemp(prefix="moa-hosts-")
        self.agent = os.path.join(self.folder, "launch_agent")

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.names.index(host) + 1}"

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self):
        switch = self.namespace("switch")
        run("ip", "netns", "add", switch)
        run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.address(h)} {h}\n" for h in self.names)
        for i, host in enumerate(self.names):
            ns = self.namespace(host)
            run("ip", "netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts_file)
            run("ip", "-n", switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.disk:
                os.makedirs(f"{self.disk}.{host}", exist_ok=True)
        if self.disk:
            os.makedirs(self.disk, exist_ok=True)
        with open(self.agent, "w") as f:  # OpenMPI calls it as ssh: <agent> <host> <command words>
            f.write(f"#!/bin/sh\nhost=\"$1\"; shift\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} "
                    f"--enter {shlex.quote(self.folder)} \"$host\" \"$*\"\n")
        os.chmod(self.agent, 0o755)
        with open(os.path.join(self.folder, "hosts.txt"), "w") as f:  # what --enter reads
            f.write(f"{self.prefix}\n{self.disk or ''}\n{' '.join(self.cold)}\n")

    def pids(self, host: str) -> list:
        """The processes running on `host`."""
        return run("ip", "netns", "pids", self.namespace(host), check=False).stdout.split()

    def __exit__(self, *exc):
        for host in [*self.names, "switch"]:
            ns, pids = self.namespace(host), self.pids(host)
            if pids:
                subprocess.run(["kill", "-9", *pids], capture_output=True)
            run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        shutil.rmtree(self.folder, ignore_errors=True)

    def mpi_environment(self) -> dict:
        """OpenMPI's settings for these hosts, as OMPI_MCA_* variables: daemons started by the launch agent instead
        of ssh, every connection between hosts on the bridge's subnet, and a waiting rank yielding its core: the
        hosts share this machine's cores, and ranks spinning on them starved the kernel's thread that carries
        packets across the bridge (ksoftirqd), 8 ms a message round trip instead of 0.1."""
        return {"OMPI_MCA_plm_rsh_agent": self.agent, "OMPI_MCA_mpi_yield_when_idle": "1",
                "OMPI_MCA_oob_tcp_if_include": f"{SUBNET}.0/24",
                "OMPI_MCA_btl_tcp_if_include": f"{SUBNET}.0/24",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

    def command(self, host: str, command: list) -> list:
        """`command` (argv) as run on `host`, through the same entry as the launch agent's."""
        return [sys.executable, __file__, "--enter", self.folder, host, "exec " + shlex.join(command)]

    def popen(self, host: str, command: list, env=None, **popen) -> subprocess.Popen:
        environment = {**os.environ, **self.mpi_environment(), **(env or {})}
        return subprocess.Popen(self.command(host, command), env=environment, **popen)


def enter(folder: str, host: str, command: str):
    """Run the shell text `command` on `host` as a login through ssh would (a login environment: PATH and HOME),
    in its network and host-name namespaces with its disk mounted (a cold host: its own home); replaces this
    process."""
    prefix, disk, cold = open(os.path.join(folder, "hosts.txt")).read().split("\n")[:3]
    home = os.path.expanduser("~")
    setup = [f"hostname {shlex.quote(host)}"]
    if disk:
        setup.append(f"mount --bind {shlex.quote(disk + '.' + host)} {shlex.quote(disk)}")
    if host in cold.split():
        home = os.path.join(folder, f"home.{host}")
        os.makedirs(home, exist_ok=True)
    script = " && ".join(setup) + f" && cd {shlex.quote(os.getcwd())} && {command}"
    login = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
             **{k: v for k, v in os.environ.items() if k.startswith(("OMPI_", "MOA_"))}}
    os.execvpe("ip", ["ip", "netns", "exec", f"{prefix}-{host}", "unshare", "--uts", "sh", "-c", script], login)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (node1 .. nodeN; node1 runs the command)")
    parser.add_argument("--disk", default=None, help="a folder each host sees holding its own files")
    parser.add_argument("--cold", default="", help="hosts (comma-separated) whose Jittor has never been prepared")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    parser.add_argument("--enter", nargs=3, metavar=("FOLDER", "HOST", "COMMAND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.enter:
        enter(*args.enter)
    why = usable()
    if why:
        sys.exit(f"error: {why}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("error: no command given (put it after --)")
    names = [f"node{i + 1}" for i in range(args.hosts)]
    with Hosts(names, disk=args.disk, cold=[h for h in args.cold.split(",") if h]) as hosts:
        return hosts.popen(names[0], command).wait()


if __name__ == "__main__":
    sys.exit(main())
