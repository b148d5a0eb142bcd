"""A real Slurm controller and one node on this machine, for tests/test_slurm.py.

Debian's `slurmctld` / `slurmd` (22.05) and `munge`, installed by tests/install_slurm.sh and
started here as root, each in the foreground as a child of the test (so the test stops exactly
the processes it started). Everything they write (config, munge key and socket, state, spool,
logs) lives under one scratch directory; the ports are free ones. The node has this machine's
CPUs and no GPUs; processes are tracked without cgroups (`proctrack/linuxproc`), which a
container allows. Clients (`sbatch`, `scontrol`, `srun` inside a job) find the cluster through
`SLURM_CONF` in `env`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

from megarl.distributed.launch import free_port


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmCluster:
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o711)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = self.root / "munge" / "munge.sock"
        m = self.root / "munge"
        self._start(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={m / 'munged.log'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
            ]  # fmt: skip
        )
        self._wait(lambda: sock.exists(), "munged's socket")
        self.conf.write_text(self._config(sock))
        self._start(["slurmctld", "-D", "-f", str(self.conf)])
        self._start(["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.scontrol("show", "node", self.node, check=False).find(
            "State=IDLE") >= 0, "the node to be idle")  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
        time.sleep(2)
        for p in reversed(self._daemons):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _config(self, sock: Path) -> str:
        r = self.root
        return f"""ClusterName=megarl-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
InactiveLimit=0
MinJobAge=600
KillWait=30
JobRequeue=1
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def _start(self, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{os.path.basename(cmd[0])}.out", "w")  # noqa: SIM115
        self._daemons.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = {f.name: f.read_text()[-2000:] for f in (self.root / "log").iterdir()}
                raise RuntimeError(f"waiting for {what}: exited {dead}; logs: {logs}")
            time.sleep(0.5)

    # ------------------------------------------------------------------ clients
    def scontrol(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)
        if check and proc.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def sbatch(self, script: str, *options: str, args=(), env=None, cwd=None) -> int:
        proc = subprocess.run(
            ["sbatch", "--parsable", *options, script, *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields of `job_id` ({} once Slurm forgot it)."""
        out = self.scontrol("show", "job", "-o", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, until, timeout: float, every: float = 2.0) -> dict[str, str]:
        """Poll the job until `until(fields)` holds; its fields then."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {fields}")
            time.sleep(every)
