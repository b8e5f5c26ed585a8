"""Does an export load with transformers 4? Load it with transformers 4.57 in a virtual environment of its own.

The export is written by transformers 5 (this package's environment). This script creates `build/transformers4/`
(a venv: torch 2.13.0 first, the CPU build, then transformers 4.57, safetensors, tokenizers; the first run needs
the package index), then, in that venv's Python, loads the folder with `AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained` and `pipeline("text-generation")`, and prints what loaded and the generated text.

    python -m zckpt_nb export runs/tiny runs/tiny-hf
    python benchmarks/load_with_transformers4.py runs/tiny-hf [--prompt "The keeper"]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

VENV = Path(__file__).resolve().parent.parent / "build" / "transformers4"
# torch first and exactly pinned: a looser pin lets pip pick a CUDA build (gigabytes) on a CPU machine
INSTALLS = (["torch==2.13.0"], ["transformers==4.57.*", "safetensors", "tokenizers"])


def venv_python(root: Path) -> Path:
    """The venv at `root`, created and filled on first use; its Python."""
    python = root / "bin" / "python"
    if not (root / ".installed").is_file():
        venv.create(root, with_pip=True, clear=True)
        for packages in INSTALLS:
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", *packages], check=True)
        (root / ".installed").write_text("\n".join(p for group in INSTALLS for p in group))
    return python


def load(model_dir: str, prompt: str, max_new_tokens: int) -> dict[str, object]:
    """Inside the transformers 4 venv: load model, tokenizer and pipeline; what loaded and the greedy text."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pipe = pipeline("text-generation", model=model_dir)
    text = pipe(prompt, max_new_tokens=max_new_tokens, do_sample=False)[0]["generated_text"]
    return {"transformers": transformers.__version__, "model": type(model).__name__,
            "tokenizer": type(tokenizer).__name__, "tokenizer entries": len(tokenizer),
            "model_max_length": tokenizer.model_max_length, "pipeline": type(pipe).__name__, "text": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a folder written by python -m zckpt_nb export")
    parser.add_argument("--prompt", default="The keeper")
    parser.add_argument("--max_new_tokens", type=int, default=30)
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # set when run in the venv
    args = parser.parse_args()
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"{args.model_dir} is not an export (no config.json); make one with: python -m zckpt_nb export CKPT OUT",
              file=sys.stderr)
        return 2
    if args.inside:
        print(json.dumps(load(args.model_dir, args.prompt, args.max_new_tokens)))
        return 0
    python = venv_python(args.venv)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from this package's environment
    done = subprocess.run([str(python), __file__, "--inside", args.model_dir, "--prompt", args.prompt,
                           "--max_new_tokens", str(args.max_new_tokens)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"transformers 4 could not load {args.model_dir}: {done.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return 1
    for key, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
