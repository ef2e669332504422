"""Running the compilers for GPU targets from the test process (tests/kernels/conftest.py's fixtures): the
environment they need (no TRITON_INTERPRET, the run's shared Triton cache) and ``kernel_audit.py --serve``."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
AUDIT = ROOT / "benchmarks" / "kernel_audit.py"


def compile_env(cache: pathlib.Path, **extra: str) -> dict:
    """This process's environment without TRITON_INTERPRET, with the shared Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return dict(env, TRITON_CACHE_DIR=str(cache), **extra)


class AuditServer:
    """``kernel_audit.py --serve``: one process, started on the first job."""

    def __init__(self, cache: pathlib.Path, log: pathlib.Path):
        self.cache, self.log, self.proc = cache, log, None

    def run(self, *args: str) -> str:
        if self.proc is None:
            self.stderr = open(self.log, "w+")  # noqa: SIM115 - closed in close()
            self.proc = subprocess.Popen([sys.executable, str(AUDIT), "--serve", "--cache-dir", str(self.cache)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                         text=True, env=compile_env(self.cache))  # fmt: skip
        self.proc.stdin.write(" ".join(args) + "\n")
        self.proc.stdin.flush()
        out = []
        for line in self.proc.stdout:
            if line.startswith("kernel_audit-done "):
                rc = int(line.split()[1])
                break
            out.append(line)
        else:
            rc = self.proc.wait()
            self.proc = None
        self.stderr.seek(0)
        err = self.stderr.read()
        if rc == 2 and "cannot run" in err:
            pytest.skip(err.strip())
        assert rc == 0, "".join(out)[-4000:] + err[-4000:]
        return "".join(out)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()  # the jobs are done: no need to wait for the interpreter's exit
            self.proc.kill()
            self.proc.wait(timeout=60)
            self.stderr.close()
