"""The GPU session's plan (bench/device_pack.py, bench/device_session.py) fits what the device tool
allows: each call's command under 2,000 characters, call 2's parts under one command's 600 s with
room for its setup, at most eight files back, and `pytest -m gpu` over every file that holds a GPU
test. (The calls themselves install into the machine's own Python and remove packages there, so
they run on the device only; the packed server is run here by tests/test_bench_served.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import device_pack  # noqa: E402
import device_session  # noqa: E402

COMMAND_LIMIT_S, SETUP_S = 600, 30


def test_call_two_fits_one_command_and_returns_its_files(tmp_path):
    assert sum(limit for _, limit, _ in device_session.PARTS) + SETUP_S <= COMMAND_LIMIT_S
    files = {"served": 4, "decoder": 2, "pytest-gpu": 1}  # served: its JSON, served.json, server.log, the log
    assert {name for name, _, _ in device_session.PARTS} == set(files) and sum(files.values()) <= 8
    served = device_session.expand(dict((n, a) for n, _, a in device_session.PARTS)["served"], tmp_path, "abc")
    assert served[served.index("--tree") + 1] == "abc" and served[served.index("--results") + 1] == str(tmp_path)


def test_pytest_gpu_runs_every_file_with_gpu_tests():
    marked = subprocess.run(["grep", "-l", "mark.gpu", *map(str, sorted((ROOT / "tests").glob("test_*.py")))],
                            capture_output=True, text=True).stdout.split()
    expanded = device_session.expand(["{gpu_tests}"], Path("/out"), "t")
    assert expanded == [str(Path(p).relative_to(ROOT)) for p in marked] and expanded


def test_the_two_calls_are_short_commands_carrying_one_folder_each():
    calls = device_pack.calls(ROOT / ".device", ROOT)
    assert [carry for carry, _ in calls] == [[".device/call1"], [".device/call2"]]
    for carry, command in calls:
        assert len(command) < 2000 and command.startswith("python3 bench/device_session.py")
    assert "--tree " in calls[1][1] and '--out "$OUT"' in calls[1][1]
    assert set(device_pack.CALLS["call1"]) == {"tritonclient", "python-rapidjson", "numpy"}
    assert device_pack.PINNED["numpy"].startswith("1.")


# What bench/device_pack.py packed for each call, MiB, as `device_pack.py .device` printed it here on
# 2026-11-29: the server archive 25.7, numpy 17.1, python-rapidjson 1.7, tritonclient 0.1; PyAV 34.1,
# transformers 12.7.
PACK_MIB = {"call1": 44.6, "call2": 46.8}


def test_each_call_fits_its_budget_with_todays_tree():
    """The tree as a call sends it (the set-aside test data left out) and each call's pack fit the
    60 MiB budget: room under the tool's 64 MiB for the tree to grow."""
    tree = device_pack.tree_bytes(ROOT)
    assert tree < device_pack.tree_bytes(ROOT, without=())  # the set-aside paths hold something
    for call, mib in PACK_MIB.items():
        assert tree + mib * 2**20 <= device_pack.CALL_BUDGET, (call, tree / 2**20)


def test_set_aside_and_restore_move_the_paths_and_back(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    (root / "tests" / "golden" / "a").mkdir(parents=True)
    (root / "tests" / "golden" / "a" / "x.npz").write_bytes(b"123")
    assert device_pack.set_aside(root) == ["tests/golden"] and not (root / "tests" / "golden").exists()
    assert device_pack.set_aside(root) == []  # again: nothing to move
    assert device_pack.set_aside(root, restore=True) == ["tests/golden"]
    assert (root / "tests" / "golden" / "a" / "x.npz").read_bytes() == b"123"
    assert device_pack.set_aside(root, restore=True) == []


def test_call_one_reports_what_arrived(tmp_path):
    (tmp_path / "tests" / "golden").mkdir(parents=True)
    (tmp_path / "a.py").write_text("x")
    (tmp_path / ".device" / "call1").mkdir(parents=True)
    (tmp_path / ".device" / "call1" / "w.whl").write_bytes(b"0" * 10)
    assert device_session.arrived(tmp_path) == {"files": 1, "mib": 0.0, "set_aside_arrived": {"tests/golden": True}}
