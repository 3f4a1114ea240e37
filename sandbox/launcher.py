"""The first program in every box (bwrap, apptainer, local).

The service's own interpreter runs this file's text as `python -S -I -c TEXT CPU MEMORY
PROCESSES FILE_SIZE UID READY_FD -- COMMAND...` (`sandbox.startup.launcher_argv`; "-" leaves a
value unset). It sets the rlimits, leaves root for the box's uid when asked, says it is ready
on the pipe READY_FD when given one, then execs COMMAND (or waits forever when there is none).
Only builtin and stdlib modules, no site-packages.
"""

import os
import resource
import sys


def limit(which: int, value: str, slack: int) -> None:
    if value == "-":
        return
    soft = int(value)
    hard = soft + slack
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def main(args: list[str]) -> None:
    cpu, memory, processes, file_size, uid, ready = args[:6]
    argv = args[7:]
    limit(resource.RLIMIT_CPU, cpu, 5)
    limit(resource.RLIMIT_AS, memory, 0)
    limit(resource.RLIMIT_NPROC, processes, 0)
    limit(resource.RLIMIT_FSIZE, file_size, 0)
    if uid != "-":
        n = int(uid)
        os.setgroups([])
        os.setresgid(n, n, n)
        os.setresuid(n, n, n)
    os.umask(0o022)
    if ready != "-":
        os.write(int(ready), b"ready\n")
        os.close(int(ready))
    if not argv:
        import signal

        while True:
            signal.pause()
    name = argv[0]
    dirs = [""] if "/" in name else os.environ.get("PATH", "/usr/bin:/bin").split(":")
    denied = None
    for d in dirs:
        try:
            os.execv(os.path.join(d, name) if d else name, argv)
        except PermissionError as exc:
            denied = exc
        except OSError:
            pass
    why = "permission denied" if denied else "no such file or directory"
    sys.stderr.write(f"sandbox: cannot run {name}: {why}\n")
    sys.stderr.flush()
    os._exit(126 if denied else 127)


if __name__ == "__main__":
    main(sys.argv[1:])
