"""A Hugging Face model folder of a named shape with seeded random weights, for measuring kvtool on
a GPU as users run it (``kvtool capture --model FOLDER ...``) without downloading weights.

The model is built on the device by :func:`kvtool.hf.shapes.build_model` and saved with
``save_pretrained`` (5 GB shards), with a byte-level tokenizer (256 byte tokens, so a text of N
bytes is N tokens) and a prompt text of ``--prompt-bytes`` bytes beside it (kvtool's built-in prompt,
repeated). Prints one JSON line: the folder, its bytes and the seconds it took.

    python scripts/scale_model_folder.py --shape llama3-8b --device cuda -o /tmp/llama3-8b --prompt-bytes 140000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def byte_tokenizer():
    """256 byte tokens + <s> (256) + </s> (257), no merges: one token per byte of the prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers (a smaller folder)")
    ap.add_argument("--prompt-bytes", type=int, default=0, help="also write FOLDER/prompt.txt of this many bytes")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    import torch

    from kvtool.hf.prompts import DEFAULT_PROMPT
    from kvtool.hf.shapes import build_model

    start = time.perf_counter()
    model = build_model(args.shape, device=args.device, layers=args.layers)
    model.save_pretrained(args.output, max_shard_size="5GB")
    byte_tokenizer().save_pretrained(args.output)
    if args.prompt_bytes:
        text = (DEFAULT_PROMPT.strip() + "\n") * (args.prompt_bytes // len(DEFAULT_PROMPT) + 1)
        (args.output / "prompt.txt").write_text(text[: args.prompt_bytes])
    size = sum(p.stat().st_size for p in args.output.glob("*.safetensors"))
    print(json.dumps({"folder": str(args.output), "shape": args.shape, "weights_bytes": size, "dtype": str(next(model.parameters()).dtype),
                      "seconds": round(time.perf_counter() - start, 1), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
