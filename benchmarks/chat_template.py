"""What a chat request pays to turn its messages into prompt text: the model's chat template compiled and rendered
(what every chat request paid before templates were compiled once per text), against rendering the compiled one
(what the server does now).

    python benchmarks/chat_template.py [--model NAME] [--reps 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, median_seconds
from kvpage.model.chat_template import compile_chat_template, render_chat_template
from kvpage.model.registry import DEFAULT_MODEL, resolve_model_path
from kvpage.model.tokenizer import KVTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model whose template is timed (a name or a path)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    if path is None:
        raise SystemExit(f"model {args.model!r} not found")
    tk = KVTokenizer.from_gguf(path) if path.suffix == ".gguf" else KVTokenizer.from_hf_dir(path)
    if not tk.chat_template:
        raise SystemExit(f"{args.model}: no chat template to time")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]

    def fresh() -> str:
        compile_chat_template.cache_clear()
        return render_chat_template(tk.chat_template, messages, True)

    def cached() -> str:
        return render_chat_template(tk.chat_template, messages, True)

    cold, warm = median_seconds(fresh, args.reps), median_seconds(cached, args.reps)
    print(f"machine: {cpu_model()}; medians of {args.reps}")
    print(f"compile + render {cold * 1e6:.0f} us, render compiled {warm * 1e6:.1f} us ({cold / warm:.0f}x)")


if __name__ == "__main__":
    main()
