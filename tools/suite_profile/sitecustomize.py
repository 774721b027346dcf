"""The sampler `tools/suite_profile.py` puts in every Python process of a profiled run (through `PYTHONPATH`).

With `MMFSDP_SUITE_PROFILE_DIR` set, each process samples its main thread every `MMFSDP_SUITE_PROFILE_INTERVAL`
seconds of its own CPU time (`ITIMER_PROF`, SIGPROF) and charges the CPU time since its previous sample (all its
threads', `time.process_time`) to the stack it interrupted, tagged with the test running (`PYTEST_CURRENT_TEST`,
which test ranks and scripts inherit) and the process's script name; a forked child starts its own timer. The
handler runs between two bytecodes, so a long C call is one late sample, which its CPU time weighs right (a count of
signals would not: they coalesce while one is pending). C code is charged to the Python frame that called it.
Microseconds go to `<dir>/<pid>.txt` every 50 samples and at exit (one `microseconds<TAB>test|script|stack` line
each). Without the variable nothing happens.
"""

import os

if os.environ.get("MMFSDP_SUITE_PROFILE_DIR"):
    import atexit
    import collections
    import signal
    import sys
    import time

    _DIR = os.environ["MMFSDP_SUITE_PROFILE_DIR"]
    _INTERVAL = float(os.environ.get("MMFSDP_SUITE_PROFILE_INTERVAL", "0.02"))
    _counts: collections.Counter = collections.Counter()
    _taken = [0]
    _last = [time.process_time()]

    def _flush() -> None:
        if not _counts:
            return
        try:
            with open(os.path.join(_DIR, f"{os.getpid()}.txt"), "a") as out:
                out.writelines(f"{count}\t{key}\n" for key, count in _counts.items())
        except OSError:
            pass
        _counts.clear()

    def _sample(signum, frame) -> None:
        stack = []
        while frame is not None and len(stack) < 80:
            stack.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
            frame = frame.f_back
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "-"
        now = time.process_time()
        _counts[f"{test}|{script}|{';'.join(reversed(stack))}"] += int((now - _last[0]) * 1e6)
        _last[0] = now
        _taken[0] += 1
        if _taken[0] % 50 == 0:
            _flush()

    def _start() -> None:
        _last[0] = time.process_time()  # a forked child's own clock starts at 0
        try:
            signal.signal(signal.SIGPROF, _sample)
            signal.setitimer(signal.ITIMER_PROF, _INTERVAL, _INTERVAL)
        except (ValueError, OSError):  # not the main thread
            pass

    def _stop() -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        _flush()

    _start()
    os.register_at_fork(after_in_child=lambda: (_counts.clear(), _start()))
    atexit.register(_stop)
    _os_exit = os._exit

    def _exit(code, _exit_=_os_exit):  # multiprocessing's children leave through os._exit, past atexit
        _stop()
        _exit_(code)

    os._exit = _exit
