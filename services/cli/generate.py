"""`kvrelay generate`: offline batch generation from a JSONL file, the guides' offline-validation stage.

Each input line holds `messages` (rendered with the chat template) or a raw `prompt`, and may carry
sampling fields. Output lines come in input order. A bad line gets an `error` object; the command then
exits with code 3 after writing every line.

An encoder-decoder model (T5, docs/encoder-decoder.md) reads the line's `prompt` (or its rendered
`messages`, where the model has a chat template) as the encoder input, with the tokenizer's special tokens
(T5's EOS); its decoder starts at the model's start token, followed by the line's optional
`decoder_prompt` text. `prompt_tokens` counts the encoder input then.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.common.config import load_config
from services.common.errors import InvalidRequestError, KvrelayError
from services.common.sampling import SamplingParams

SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
    "presence_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "n",
)  # fmt: skip
EXIT_SOME_LINES_FAILED = 3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline batch generation from a JSONL file")
    p.add_argument("--input", required=True, type=Path, help="JSONL: one {messages|prompt, ...} per line")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--model", default=None, help="model directory (default: model.path from the config)")
    p.add_argument("--config", default=None, help="kvrelay YAML config")
    p.add_argument("--max-tokens", type=int, default=None, help="default max_tokens for lines without one")
    p.add_argument("--temperature", type=float, default=None, help="default temperature (default 0: greedy)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run)


@dataclass
class _Line:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    encoder_ids: list[int] | None = None  # an encoder-decoder model's input; prompt_ids are the decoder's


def run(args: argparse.Namespace) -> int:
    from services.codec.text.tokenizer import Tokenizer
    from services.engine.loading.factory import build_core

    cfg = load_config(args.config)
    model_update: dict[str, Any] = {}
    if args.model:
        model_update["path"] = args.model
    if args.dtype:
        model_update["dtype"] = args.dtype
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model_update)})
    tokenizer = Tokenizer.from_dir(Path(cfg.model.path))
    engine = build_core(cfg)
    defaults = {
        "max_tokens": args.max_tokens or cfg.limits.default_max_output_tokens,
        "temperature": 0.0 if args.temperature is None else args.temperature,
    }
    raw_lines = args.input.read_text().splitlines()
    results: dict[int, dict[str, Any]] = {}
    accepted: list[_Line] = []
    decoder_start = engine.model_config.bos_token_id if engine.model_config.is_encoder_decoder else None
    for index, raw in enumerate(raw_lines):
        try:
            line = _parse_line(index, raw, tokenizer, defaults, decoder_start)
            engine.add_request(
                str(index), line.prompt_ids, line.params, encoder_token_ids=line.encoder_ids or ()
            )
            accepted.append(line)
        except (KvrelayError, ValueError, TypeError) as exc:
            results[index] = {"index": index, "error": {"type": type(exc).__name__, "message": str(exc)}}
    _run_to_completion(engine, accepted, tokenizer, results, show=not args.no_progress)
    engine.close()  # the KV tiers' queued writes, when they are on
    with args.output.open("w") as out:
        for index in range(len(raw_lines)):
            out.write(json.dumps(results[index], ensure_ascii=False) + "\n")
    num_failed = sum(1 for r in results.values() if "error" in r)
    print(f"wrote {len(raw_lines)} lines to {args.output} ({num_failed} failed)", file=sys.stderr)
    return EXIT_SOME_LINES_FAILED if num_failed else 0


def _parse_line(
    index: int, raw: str, tokenizer, defaults: dict[str, Any], decoder_start: int | None = None
) -> _Line:
    from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"line {index + 1} is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"line {index + 1} is not a JSON object")
    if "messages" in obj:
        template = chat_template_from_tokenizer(tokenizer)
        prompt_ids = render_and_encode(template, tokenizer, obj["messages"])
    elif isinstance(obj.get("prompt"), str):
        prompt_ids = tokenizer.encode(obj["prompt"], add_special_tokens=True)
    else:
        raise InvalidRequestError(f"line {index + 1} needs `messages` or a string `prompt`")
    fields = {**defaults, **{k: obj[k] for k in SAMPLING_FIELDS if k in obj}}
    stop_ids = tuple(obj.get("stop_token_ids", ()))
    params = SamplingParams(**fields, stop_token_ids=stop_ids)
    if decoder_start is None:
        if "decoder_prompt" in obj:
            raise InvalidRequestError(f"line {index + 1}: decoder_prompt is for encoder-decoder models only")
        return _Line(index, prompt_ids, params)
    decoder = [decoder_start, *tokenizer.encode(obj.get("decoder_prompt", ""), add_special_tokens=False)]
    return _Line(index, decoder, params, encoder_ids=prompt_ids)


def _run_to_completion(engine, lines: list[_Line], tokenizer, results: dict[int, dict[str, Any]], show: bool):
    by_id = {str(line.index): line for line in lines}
    outputs: dict[str, dict[int, list[int]]] = {rid: {} for rid in by_id}
    reasons: dict[str, dict[int, str]] = {rid: {} for rid in by_id}
    cached: dict[str, int] = {}
    num_open = sum(line.params.n for line in lines)
    with tqdm(total=num_open, disable=not show, desc="generate", unit="seq") as bar:
        while engine.has_work():
            for out in engine.step():
                outputs[out.request_id].setdefault(out.index, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
                if out.finish_reason is not None:
                    reasons[out.request_id][out.index] = out.finish_reason.value
                    bar.update(1)
    for rid, line in by_id.items():
        choices = []
        for i in range(line.params.n):
            ids = outputs[rid].get(i, [])
            choices.append(
                {"text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": reasons[rid].get(i)}
            )
        first = choices[0]
        results[line.index] = {
            "index": line.index,
            **first,
            **({"choices": choices} if line.params.n > 1 else {}),
            "prompt_tokens": len(line.encoder_ids or line.prompt_ids),
            "completion_tokens": sum(len(c["token_ids"]) for c in choices),
            "cached_tokens": cached.get(rid, 0),
        }
