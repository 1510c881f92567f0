"""A warm interpreter that forks `python -m moe_train ...` runs for the tests.

Every CLI run of the test suite used to start a fresh interpreter, and importing torch alone takes
about 3 s of CPU on a small machine: hundreds of runs, a large share of CI. This process imports
torch once, then forks one child per request; the child takes the request's working directory,
environment, stdin, stdout and stderr, runs the `moe_train` module as ``python -m moe_train``
would, and exits through the normal interpreter shutdown (atexit handlers and stdio flushed), so
its exit status, output and files are those of a real run. torch (which prints nothing and
starts no thread of its own when imported) is loaded and frozen before the fork; the modules
named as arguments (``python zygote.py torch._dynamo transformers``, for the runs that train or
convert) are imported after the freeze (see `main`); the rest each child imports itself.

Protocol (one JSON object per line): requests on the stdin this process was started with, each
``{"id", "argv", "cwd", "env", "stdin", "stdout", "stderr"}`` (the last three are file paths;
an optional ``"append": true`` appends to stdout and stderr instead of truncating them, an
optional ``"script"`` path runs that file as ``python SCRIPT ARGV`` instead of ``-m moe_train``);
replies on its stdout, ``{"id", "pid"}`` when the child started, then ``{"id", "status"}`` with
the status as `subprocess` reports it (negative: killed by that signal). End of input ends it.
"""

import os
import sys

# The request pipe and the reply pipe move off fds 0 and 1, so that a child's stdin and stdout are
# only the files of its request; /dev/null stands in until then.
REQUESTS, REPLIES = os.dup(0), os.dup(1)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
os.close(_null)
sys.path[0:1] = []  # this file's folder; a child puts its own working directory there

import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import runpy  # noqa: E402
import selectors  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402,F401  (the point of this process)


def _child(request: dict, selector: selectors.BaseSelector) -> None:
    """Become the requested run; never returns (SystemExit leaves through the interpreter)."""
    for fd in [*selector.get_map(), REPLIES]:  # the pipes, the other children's pidfds
        os.close(fd)
    selector.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # "append": the run shares its output files with others (the ranks of one job)
    out = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request.get("append") else os.O_TRUNC)
    for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                            (1, request["stdout"], out), (2, request["stderr"], out)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    random.seed()  # a fresh interpreter seeds from the OS, not from its parent's state
    script = request.get("script")
    sys.argv = [script or "-m", *request["argv"]]
    # as `python SCRIPT` / `python -m` do
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)) if script else os.getcwd())
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("moe_train", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    sys.exit(code)


def _reply(message: dict) -> None:
    os.write(REPLIES, (json.dumps(message) + "\n").encode())


def main(preload: list[str]) -> None:
    # What is loaded now stays for good: the collector then never walks it, neither in a child's
    # collections nor at its exit (0.4 s instead of 1.1 s for a child that only exits).
    gc.freeze()
    # The modules named on the command line are imported after the freeze: frozen, triton's
    # objects (torch._dynamo and transformers load it) would outlive every child's final
    # collection, and triton's leak check would print at each exit. A child then pays ~1 s
    # more at exit to collect them, and saves 2-6 s of importing them itself.
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    selector = selectors.DefaultSelector()
    selector.register(REQUESTS, selectors.EVENT_READ, None)
    pending = b""
    open_input = True
    while open_input or len(selector.get_map()) > 1:
        for key, _ in selector.select():
            if key.data is None:  # requests
                chunk = os.read(REQUESTS, 1 << 16)
                if not chunk:
                    open_input = False
                    selector.unregister(REQUESTS)
                    continue
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        _child(request, selector)
                    pidfd = os.pidfd_open(pid)
                    selector.register(pidfd, selectors.EVENT_READ, (request["id"], pid))
                    _reply({"id": request["id"], "pid": pid})
            else:  # a child ended
                rid, pid = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _reply({"id": rid, "status": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main(sys.argv[1:])
