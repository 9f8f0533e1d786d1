"""`triton-vlm serve` as a user runs it: readiness, SIGTERM, and a model that fails to load; the
`demo-checkpoint` command for every family."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import pytest

from triton_vlm.families import FAMILIES, detect_family
from triton_vlm.server.tritonserver import free_port

SERVE = [sys.executable, "-m", "triton_vlm.tools.cli", "serve"]


def _ports() -> list[str]:
    return ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]


def _wait_ready(process: subprocess.Popen, http_port: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "serve exited before the server was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("not ready")


@contextlib.contextmanager
def _serving(args: list[str], http_port: str, log) -> Iterator[subprocess.Popen]:
    """`triton-vlm serve ARGS` ready; when the `with` ends, SIGTERM stops it with exit code 0 (it is
    killed if it does not)."""
    process = subprocess.Popen(SERVE + args, stdout=log, stderr=log)
    try:
        _wait_ready(process, http_port)
        yield process
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_stops_cleanly_on_sigterm(tiny_repo, tmp_path):
    ports = _ports()
    with _serving(["--repo", str(tiny_repo), *ports], ports[1], open(tmp_path / "serve.log", "w")):
        pass


def test_serve_exits_nonzero_with_the_servers_error_when_a_model_fails(tiny_repo, tmp_path):
    broken = tmp_path / "repository"
    shutil.copytree(tiny_repo, broken)
    (broken / "vision_encoder" / "1" / "encoder.onnx").write_bytes(b"not an onnx file")
    process = subprocess.run(SERVE + ["--repo", str(broken), *_ports()], capture_output=True, text=True, timeout=300)
    assert process.returncode != 0
    assert "vision_encoder" in process.stderr and "failed to load" in process.stderr


def _sockets(port: int) -> list[tuple[str, str]]:
    """(local address, state) of this machine's TCP sockets on local `port`, from /proc/net/tcp and
    tcp6 (IPv4-mapped IPv6 addresses as IPv4; states `0A` listening, `06` TIME_WAIT)."""
    import ipaddress

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in (line.split() for line in open(table).read().splitlines()[1:]):
            address, local_port = row[1].split(":")
            if int(local_port, 16) != port:
                continue
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            packed = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            ip = ipaddress.ip_address(packed)
            found.append((str(getattr(ip, "ipv4_mapped", None) or ip), row[3]))
    return found


def _ready_line(log, process: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in open(log.name).read().splitlines() if line.startswith("ready: ")]
        if lines:
            return lines[-1]
        assert process.poll() is None, "serve exited"
        time.sleep(0.2)
    raise AssertionError("no ready line")


def test_port_in_use_sees_a_listener_and_not_a_port_in_time_wait():
    """The port check binds as tritonserver does (SO_REUSEADDR): the connections a stopped server
    leaves in TIME_WAIT do not keep the next one off its port; a listener does."""
    import socket

    from triton_vlm.server.tritonserver import port_in_use

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert port_in_use(port) and port_in_use(port, "127.0.0.1")
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
    listener.close()
    client.recv(1)
    client.close()
    assert ("127.0.0.1", "06") in _sockets(port)
    assert not port_in_use(port) and not port_in_use(port, "127.0.0.1")


def test_serve_binds_its_host_and_starts_again_at_once_on_the_same_ports(lean_repo, tmp_path):
    """`serve --host 127.0.0.1` binds gRPC, HTTP and metrics there and its ready line says so;
    stopped, with its connections in TIME_WAIT, a new `serve` (the default host, 0.0.0.0) starts at
    once on the same ports, as tritonserver itself can."""
    ports = _ports()
    numbers = [int(p) for p in ports[1::2]]
    lines = {"127.0.0.1": "ready: gRPC 127.0.0.1:{1}, HTTP 127.0.0.1:{0}, metrics 127.0.0.1:{2};",
             "0.0.0.0": "ready: gRPC 0.0.0.0:{1}, HTTP 0.0.0.0:{0}, metrics 0.0.0.0:{2};"}
    for run, host in enumerate(("127.0.0.1", None)):
        log = open(tmp_path / f"serve{run}.log", "w")
        args = ["--repo", str(lean_repo), *ports, *(["--host", host] if host else [])]
        host = host or "0.0.0.0"
        with _serving(args, ports[1], log) as process:
            assert _ready_line(log, process).startswith(lines[host].format(*numbers))
            # each endpoint listens at that address alone (for 0.0.0.0, gRPC takes IPv6's wildcard too)
            for port in numbers:
                listening = {address for address, state in _sockets(port) if state == "0A"}
                assert listening == {host} or host == "0.0.0.0" and listening == {"::"}, (port, listening)
            for _ in range(3):  # connections the server closes first: they wait in TIME_WAIT on its port
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/v2/health/ready", timeout=5):
                    pass
        if run == 0:
            assert any(state == "06" for _, state in _sockets(numbers[0])), "no TIME_WAIT left: nothing tested"


def test_infer_streams_the_answer_and_reports_timings(server, tmp_path):
    import json

    from triton_vlm.media import samples

    image = tmp_path / "picture.png"
    image.write_bytes(samples.image_bytes(120, 90, fmt="PNG"))
    base = [sys.executable, "-m", "triton_vlm.tools.cli", "infer", "--url", server.grpc_url, "--image", str(image),
            "--prompt", "What is this?", "--max-tokens", "5"]
    streamed = subprocess.run(base + ["--stream"], capture_output=True, text=True, timeout=120)
    assert streamed.returncode == 0, streamed.stderr
    assert "5 tokens, finish_reason=length, time to first token" in streamed.stderr
    report = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=120)
    answer = json.loads(report.stdout)
    assert answer["tokens"] == 5 and answer["finish_reason"] == "length" and answer["time_to_first_token_s"] > 0
    assert streamed.stdout == answer["text"]


def test_infer_applies_the_chat_template(server, tiny_checkpoint, tmp_path):
    """By default `--prompt` is one user turn through the chat template (the server's, or that of
    `--checkpoint`): the same answer as `--raw-prompt` with the processor's rendering of that turn."""
    import json

    from transformers import AutoProcessor

    from triton_vlm.media import samples

    image = tmp_path / "picture.png"
    image.write_bytes(samples.image_bytes(120, 90, fmt="PNG"))
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    rendered = AutoProcessor.from_pretrained(tiny_checkpoint).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    base = [sys.executable, "-m", "triton_vlm.tools.cli", "infer", "--url", server.grpc_url, "--image", str(image),
            "--max-tokens", "8", "--json"]
    runs = [subprocess.run(base + flags, capture_output=True, text=True, timeout=120)
            for flags in (["--prompt", "What is this?"],
                          ["--prompt", "What is this?", "--checkpoint", str(tiny_checkpoint)],
                          ["--prompt", rendered, "--raw-prompt"])]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    answers = [{k: json.loads(run.stdout)[k] for k in ("text", "output_ids", "finish_reason")} for run in runs]
    assert answers[0] == answers[1] == answers[2]


def test_infer_reports_invalid_input(server, tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 truncated")
    done = subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "infer", "--url", server.grpc_url, "--image",
                           str(broken), "--prompt", "?", "--max-tokens", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "images[0]" in done.stderr


# Families transformers has no class for: their oracle is the official code's golden set.
OFFICIAL_ONLY = {"minicpmv2_0", "minicpmv2_5", "minicpmv2_6", "minicpmv4_0", "minicpmv4_5"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - OFFICIAL_ONLY))
def test_demo_checkpoint_small_loads_offline_in_transformers(family, tmp_path):
    """`triton-vlm demo-checkpoint --size small` (the demo's and benchmarks' size; the tests use
    tiny) writes what transformers loads offline, and the checkpoint is detected as that family.
    The command runs in this process (a process of its own: the MiniCPM-V 4.5 test below)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from triton_vlm.tools.cli import main

    out = tmp_path / family
    assert main(["demo-checkpoint", "--family", family, "--size", "small", "--out", str(out)]) == 0
    assert detect_family(out).name == family
    processor = AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.model_type == FAMILIES[family].model_types[0]
    assert processor.tokenizer.convert_tokens_to_ids(FAMILIES[family].prompt.named_special_tokens["image_token"]) \
        == model.config.image_token_id


@pytest.mark.parametrize("family", sorted(OFFICIAL_ONLY))
def test_demo_checkpoint_of_a_remote_code_version_has_the_official_layout(family, tmp_path):
    """A remote-code MiniCPM-V version's tiny demo checkpoint holds the weights of its official
    golden checkpoint (written by the official code, the same shape): every name, every shape but
    the vocabulary's rows; the processor's fields are the official's too. (The command itself is run
    for one version; the others are written in process.)"""
    from safetensors import safe_open

    from tests.minicpmv_golden import SETS
    from triton_vlm.families.demo import write_demo_checkpoint

    golden, out = SETS[family].root, tmp_path / family
    if family == "minicpmv4_5":
        subprocess.run([sys.executable, "-m", "triton_vlm.tools.cli", "demo-checkpoint", "--family", family, "--out",
                        str(out)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    else:
        write_demo_checkpoint(family, out)
    assert detect_family(out).name == family

    def layout(checkpoint):
        with safe_open(checkpoint / "model.safetensors", "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    ours, official = layout(out), layout(golden)
    assert set(ours) == set(official)
    vocab = {"llm.model.embed_tokens.weight", "llm.lm_head.weight"}
    assert {n: s for n, s in ours.items() if n not in vocab} == {n: s for n, s in official.items() if n not in vocab}
    assert all(ours[n][1:] == official[n][1:] for n in vocab)
    if not (golden / "preprocessor_config.json").is_file():  # 2.0: the processing's settings in config.json
        assert not (out / "preprocessor_config.json").exists()
        config, official_config = (json.loads((c / "config.json").read_text()) for c in (out, golden))
        assert set(config) == set(official_config) - {"transformers_version"}
        return
    processor, official_processor = (json.loads((c / "preprocessor_config.json").read_text()) for c in (out, golden))
    sized = ("scale_resolution", "max_slice_nums")
    assert {k: v for k, v in processor.items() if k not in sized} == {
        k: official_processor[k] for k in processor if k not in sized}


def test_llm_device_and_dtype_are_build_options(tiny_checkpoint, tmp_path):
    """`--llm-device` / `--llm-dtype` reach the llm's config parameters (LLMModel passes them to the
    Engine); an empty dtype follows the device; a bad value is refused by the llm's own parser
    before anything is written."""
    import json

    from triton_vlm.repository.build import build_repository
    from triton_vlm.repository.configs import model_configs
    from triton_vlm.repository.options import BuildOptions
    from triton_vlm.tools.cli import build_options, parser

    family, config = detect_family(tiny_checkpoint), json.loads((tiny_checkpoint / "config.json").read_text())

    def llm_params(*flags: str) -> dict[str, str]:
        args = parser().parse_args(["build", "--checkpoint", "c", "--repo", "r", *flags])
        params = model_configs(family, config, build_options(args))["llm"].parameters
        return {k: params[k].string_value for k in ("device", "dtype")}

    assert build_options(parser().parse_args(["build", "--checkpoint", "c", "--repo", "r", "--llm-device", "cuda:1",
                                              "--llm-dtype", "float16"])) \
        == BuildOptions(llm_device="cuda:1", llm_dtype="float16")
    assert llm_params() == {"device": "cpu", "dtype": "float32"}
    assert llm_params("--llm-dtype", "bfloat16") == {"device": "cpu", "dtype": "bfloat16"}
    assert llm_params("--llm-device", "cuda") == {"device": "cuda", "dtype": "bfloat16"}
    assert llm_params("--llm-device", "cuda:1", "--llm-dtype", "float16") == {"device": "cuda:1", "dtype": "float16"}
    for options, message in ((BuildOptions(llm_device="gpu"), "llm device 'gpu': expected cpu, cuda or cuda:N"),
                             (BuildOptions(llm_dtype="fp16"), "llm dtype 'fp16': expected float32, bfloat16, float16")):
        with pytest.raises(ValueError, match=message):
            build_repository(tiny_checkpoint, tmp_path / "repository", options)
        assert not (tmp_path / "repository").exists()
