"""The README's curl example and examples/grpc_stream.py, run as a user would, against the session server."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from triton_vlm.media import samples

ROOT = Path(__file__).resolve().parent.parent


def readme_curl_example() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith("curl ")]
    return block


def test_readme_curl_example_answers(server, tmp_path):
    image = tmp_path / "cat.jpg"
    image.write_bytes(samples.image_bytes(200, 150))
    command = readme_curl_example().replace("localhost:8000", server.http_url).replace("cat.jpg", str(image))
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    answer = json.loads(done.stdout)
    assert answer["finish_reason"] in ("length", "stop")
    assert len(answer["output_ids"]) == 16 or answer["finish_reason"] == "stop"


def test_grpc_stream_example_prints_the_answer(server, tmp_path):
    from triton_vlm.clients.client import generate

    image = tmp_path / "picture.png"
    image.write_bytes(samples.image_bytes(120, 90, fmt="PNG"))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "grpc_stream.py"), "--url", server.grpc_url,
                           "--image", str(image), "--max-tokens", "6", "What is it?"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prompt = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
              "<|im_start|>assistant\n")
    expected = generate(server.grpc_url, prompt, [image.read_bytes()], max_tokens=6)
    assert done.stdout == expected.text + "\n"
