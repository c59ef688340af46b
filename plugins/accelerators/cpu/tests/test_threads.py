"""Binding OpenMP threads to cores: the cpulist format, and a real binding
in a fresh process (its team pinned one thread per allowed core, the
calling thread first)."""

import os
import subprocess
import sys
import textwrap

import pytest
from plinth_plugin_cpu.threads import parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]
    for bad in ("", "1,1", "-1", "a"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no per-thread affinity on this OS")
def test_binding_pins_the_team_one_thread_per_core():
    cores = sorted(os.sched_getaffinity(0))
    threads = min(2, len(cores))
    code = textwrap.dedent(f"""
        import os, threading, torch
        torch.set_num_threads({threads})
        from plinth_plugin_cpu.threads import bind_threads
        done = {{}}
        def run():
            done["msg"] = bind_threads("auto", threads={threads})
            done["me"] = os.sched_getaffinity(0)
            # while this thread lives (its team's workers end with it)
            masks = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]
            done["pinned"] = sum(1 for m in masks if len(m) == 1)
        t = threading.Thread(target=run); t.start(); t.join()
        print(done["msg"]); print(sorted(done["me"]))
        print(done["pinned"])
        print(sorted(os.sched_getaffinity(0)) == {cores!r})  # the main thread is left alone
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    msg, master, pinned, main_free = out.stdout.strip().splitlines()[-4:]
    assert msg.startswith(f"bound {threads} OpenMP threads"), msg
    assert master == str([cores[0]])
    assert int(pinned) >= threads  # the master and its workers, one core each
    assert main_free == "True"


def test_none_and_too_few_cores_do_not_bind():
    from plinth_plugin_cpu.threads import bind_threads

    assert bind_threads("none", threads=2).startswith("not bound")
    cores = sorted(os.sched_getaffinity(0))
    assert bind_threads(str(cores[0]), threads=len(cores) + 1).startswith("not bound")
