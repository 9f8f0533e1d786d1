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
