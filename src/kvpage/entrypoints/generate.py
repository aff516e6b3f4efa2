"""``kvpage generate``: complete prompts offline with the engine, optionally streaming tokens."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from kvpage.engine.arg_utils import EngineArgs
from kvpage.sampling_params import BeamSearchParams, SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="complete prompts with the engine",
        description="Generate completions for one or more prompts on the paged-KV engine.",
    )
    p.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--chat-template", help="a Jinja chat template for --chat, as a file or inline (default: the "
                                           "model's own)")
    p.add_argument("-n", type=int, default=1, help="completions per prompt (the prompt is computed once)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0, as vLLM)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--bad-word", action="append", dest="bad_words",
                   help="a word the output must not complete (repeatable; vLLM's bad_words)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, help="also report the top-N logprobs of each token (with --json)")
    p.add_argument("--sample-seed", type=int, help="per-request seed: the same seed reproduces the output")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt, n=1)")
    p.add_argument("--json", action="store_true", help="print full RequestOutputs as JSON")
    p.add_argument("--beam-width", type=int, help="beam search with this many beams (-n of them printed, best "
                                                  "first; sampling options other than --temperature do not apply)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score = logprob / len ** this")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params: SamplingParams | BeamSearchParams
    if args.beam_width is not None:
        if args.stream or args.logprobs is not None or args.stop or args.bad_words:
            raise ValueError("--beam-width does not stream and takes no --logprobs, --stop or --bad-word")
        params = BeamSearchParams(beam_width=args.beam_width, n=args.n, max_tokens=args.max_tokens,
                                  min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                                  temperature=args.temperature,
                                  length_penalty=args.length_penalty)
        args.n = params.n
    else:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs, seed=args.sample_seed,
            bad_words=args.bad_words, output_kind="delta" if args.stream else "cumulative",
        )
    template = None
    if args.chat_template is not None:
        if not args.chat:
            raise ValueError("--chat-template applies to --chat prompts: add --chat")
        from kvpage.model.chat_template import resolve_chat_template

        template = resolve_chat_template(args.chat_template)
    if args.stream and (len(args.prompts) != 1 or args.n != 1 or args.json):
        raise ValueError("--stream prints a single completion: give one prompt, -n 1 and no --json")
    from kvpage.engine.llm import LLM
    from kvpage.worker.follower import run_node

    engine_args = EngineArgs.from_cli_args(args)
    parallel = engine_args.parallel_config()
    if parallel is not None and not parallel.leads:  # another host's ranks: follow node 0 until it stops
        return run_node(parallel, engine_args.model_config(), engine_args.cache_config())
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    tk = llm.get_tokenizer()
    prompts = []
    for text in args.prompts:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}]
            rendered = tk.apply_chat_template(messages, chat_template=template)
            prompts.append({"prompt": text, "prompt_token_ids": tk.encode(rendered, add_special_tokens=False)})
        else:
            prompts.append(text)
    t_ready = time.perf_counter()
    if args.stream:
        engine = llm.engine
        engine.add_request("stream-0", prompts[0], params)
        first = None
        while engine.has_unfinished_requests():
            for ro in engine.step():
                if ro.outputs and ro.outputs[0].text:
                    first = first or time.perf_counter()
                    sys.stdout.write(ro.outputs[0].text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        _report(engine, t0, t_ready, first)
        llm.shutdown()
        return 0
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    if args.json:
        print(json.dumps([dataclasses.asdict(o) for o in outs], indent=2, default=str))
    else:
        for i, ro in enumerate(outs):
            for c in ro.outputs:
                if len(outs) > 1 or len(ro.outputs) > 1:
                    print(f"--- prompt {i}, completion {c.index} (finish: {c.finish_reason}) ---")
                print(c.text)
    _report(llm.engine, t0, t_ready, None)
    llm.shutdown()
    return 0


def _report(engine, t0: float, t_ready: float, first: float | None) -> None:
    sys.stdout.flush()
    t = time.perf_counter()
    n = engine.num_generated_tokens
    extra = f", first token {first - t0:.2f} s after start" if first else ""
    print(f"[kvpage] {n} tokens in {t - t_ready:.2f} s ({n / max(t - t_ready, 1e-9):.1f} tok/s); "
          f"startup {t_ready - t0:.2f} s{extra}", file=sys.stderr)
