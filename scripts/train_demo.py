"""Train the shipped demo model on the Python documentation that comes with CPython.

Reproduces ``src/hetforge/assets/demo/``: a byte-level BPE tokenizer and a small Llama-style model
(RMSNorm, rotary, SwiGLU, GQA 8/2) trained on ``pydoc_data.topics``. The text is the topics sorted by
name, joined with the end-of-text token; the last ``--val-frac`` of the characters is held back as
validation text and the split is written to ``training.json`` (so perplexity can be measured on it).

Seeded and single-threaded (``torch.set_num_threads(1)``): the same command on the same machine gives
the same weights. The checkpoint with the lowest validation loss is kept. Writes into a temporary
folder and renames it into place at the end, so an interrupted run leaves no half-written assets.

    python scripts/train_demo.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch

from hetforge.models.demo import EOT, corpus, split_text

ASSETS = Path(__file__).resolve().parents[1] / "src" / "hetforge" / "assets" / "demo"


def train_tokenizer(train_text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = train_text.split(EOT)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode(tok, text: str) -> torch.Tensor:
    ids: list[int] = []
    eot = tok.token_to_id(EOT)
    for i, doc in enumerate(text.split(EOT)):
        if i:
            ids.append(eot)
        ids.extend(tok.encode(doc).ids)
    return torch.tensor(ids, dtype=torch.long)


def make_config(vocab: int, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    losses = []
    for i in range(n):
        chunk = data[i * seq: i * seq + seq + 1]
        logits = model(input_ids=chunk[None, :-1]).logits[0]
        losses.append(torch.nn.functional.cross_entropy(logits, chunk[1:]).item())
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    names, text = corpus()
    train_text, val_text, cut = split_text(text, args.val_frac)
    tok = train_tokenizer(train_text, args.vocab)
    vocab = tok.get_vocab_size()
    train_ids, val_ids = encode(tok, train_text), encode(tok, val_text)
    print(f"corpus {len(text)} chars, train {len(train_ids)} tokens, val {len(val_ids)} tokens, vocab {vocab}")

    from transformers import LlamaForCausalLM

    cfg = make_config(vocab, args)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f} M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    best = (float("inf"), -1, None)
    history = []
    t0 = time.perf_counter()
    train_loss = float("nan")
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,), generator=g)
        batch = torch.stack([train_ids[s: s + args.seq + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss = 0.9 * train_loss + 0.1 * loss.item() if step else loss.item()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(model, val_ids, args.seq)
            history.append({"step": step + 1, "train_loss": round(train_loss, 4), "val_loss": round(val, 4),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"step {step + 1:5d}  train {train_loss:.3f}  val {val:.3f}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            if val < best[0]:
                best = (val, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    seconds = time.perf_counter() - t0
    model.load_state_dict(best[2])
    final_train = evaluate(model, train_ids, args.seq)
    print(f"final (best step {best[1]}): train loss {final_train:.3f}, val loss {best[0]:.3f} "
          f"(val perplexity {math.exp(best[0]):.1f}); {seconds:.0f} s training")
    save(model, tok, args, {
        "seed": args.seed, "steps": args.steps, "best_step": best[1], "batch": args.batch, "seq": args.seq,
        "lr": args.lr, "warmup": args.warmup, "threads": args.threads, "parameters": n_params,
        "train_seconds": round(seconds, 1), "final_train_loss": round(final_train, 4),
        "final_val_loss": round(best[0], 4), "history": history,
        "split": {
            "source": "pydoc_data.topics (CPython), topics sorted by name, joined with '<|endoftext|>'",
            "total_chars": len(text), "val_start_char": cut, "val_frac": args.val_frac,
            "first_val_topic": names[text[:cut].count(EOT)] if cut < len(text) else None,
            "train_tokens": len(train_ids), "val_tokens": len(val_ids),
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        },
    })


def save(model, tok, args, record: dict) -> None:
    """Write the HF folder to a temporary sibling, then swap it into place."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    out: Path = args.out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = model.config
    cfg.dtype = "float16"
    cfg.to_json_file(str(tmp / "config.json"))
    sd = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   unk_token=None, model_max_length=512)
    fast.save_pretrained(str(tmp))
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
