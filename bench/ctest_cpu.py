#!/usr/bin/env python3
"""Where a ctest run's CPU goes: samples /proc once a second while ctest runs, charges every process to the test
that started it (its ancestor among ctest's children), and prints each test's wall and CPU seconds, the machine's
busy, idle and steal shares, and the CPU no test owns (daemons such as slurmd or redis started by a test and left
running are charged to no test). The idle CPU is also charged, second by second, to the tests that ran alone while
it was idle ("idle_while": where the schedule leaves cores unused).
  bench/ctest_cpu.py BUILD_DIR OUT.json [CTEST ARGS...]     runs ctest -j$(nproc) in BUILD_DIR
"""
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def procs():
    """pid -> (ppid, own and reaped children's CPU seconds)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rindex(")") + 2:].split()
        ppid = int(rest[1])
        cpu = sum(int(x) for x in rest[11:15]) / TICK  # utime stime cutime cstime
        out[int(d)] = (ppid, cpu)
    return out


def machine():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait, "steal": steal}


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def main():
    build, out_path, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    listing = json.loads(subprocess.run(["ctest", "--show-only=json-v1", *extra], cwd=build, capture_output=True,
                                        text=True, check=True).stdout)
    by_command = {tuple(t["command"]): t["name"] for t in listing["tests"] if "command" in t}
    # A wrapper that execs (bash ... exec python) no longer shows ctest's command: such a process is named by the
    # longest of a test's path arguments (its work folder) that its own command line contains.
    by_path = sorted(((a, t["name"]) for t in listing["tests"] for a in t.get("command", [])[1:]
                      if a.startswith(os.path.abspath(build) + os.sep)), key=lambda p: -len(p[0]))
    m0, t0 = machine(), time.time()
    ctest = subprocess.Popen(["ctest", "-j", str(os.cpu_count()), *extra], cwd=build)
    tests = {}  # root pid -> {"name", "cpu", "start", "end"}
    idle_while, last = {}, machine()  # running roots (a tuple) -> idle CPU seconds in those samples
    while True:
        now = time.time()
        m = machine()
        idle = (m["idle"] - last["idle"]) / TICK
        last = m
        table = procs()
        subtree = {}
        for pid, (ppid, cpu) in table.items():
            root, p, hops = None, pid, 0
            while p in table and hops < 64:
                if table[p][0] == ctest.pid:
                    root = p
                    break
                p, hops = table[p][0], hops + 1
            if root is not None:
                subtree[root] = subtree.get(root, 0.0) + cpu
        for root, cpu in subtree.items():
            t = tests.setdefault(root, {"argv": cmdline(root), "cpu": 0.0, "start": now - t0})
            t["cpu"] = max(t["cpu"], cpu)
            t["end"] = now - t0
        key = tuple(sorted(subtree))
        idle_while[key] = idle_while.get(key, 0.0) + idle
        if ctest.poll() is not None:
            break
        time.sleep(1.0)
    m1 = machine()
    label = {}
    for root, t in tests.items():
        line = " ".join(t["argv"])
        label[root] = by_command.get(tuple(t["argv"])) or next((n for a, n in by_path if a in line), line[:80])
    rows = sorted(({"test": label[root], "start": round(t["start"]),
                    "wall": round(t["end"] - t["start"], 1), "cpu": round(t["cpu"], 1)}
                   for root, t in tests.items()), key=lambda r: -r["cpu"])
    idle_rows = sorted(({"running": [label[r] for r in key] or ["(nothing: ctest itself)"],
                         "idle_cpu_s": round(v, 1)} for key, v in idle_while.items() if v >= 1.0),
                       key=lambda r: -r["idle_cpu_s"])
    ticks = {k: (m1[k] - m0[k]) / TICK for k in m1}
    total = sum(ticks.values())
    summary = {"wall": round(time.time() - t0, 1), "cpus": os.cpu_count(), "ctest_rc": ctest.returncode,
               "busy_cpu_s": round(ticks["busy"], 1), "idle_cpu_s": round(ticks["idle"], 1),
               "steal_cpu_s": round(ticks["steal"], 1), "tests_cpu_s": round(sum(r["cpu"] for r in rows), 1),
               "busy_share": round(ticks["busy"] / total, 3) if total else None}
    json.dump({"summary": summary, "tests": rows, "idle_while": idle_rows}, open(out_path, "w"), indent=1)
    print(json.dumps(summary))
    for r in rows[:40]:
        print(f"{r['cpu']:8.1f} cpu-s {r['wall']:8.1f} s  {r['test']}")
    print("idle CPU while only these ran:")
    for r in idle_rows[:15]:
        print(f"{r['idle_cpu_s']:8.1f} idle cpu-s  {', '.join(r['running'])}")
    return ctest.returncode


if __name__ == "__main__":
    sys.exit(main())
