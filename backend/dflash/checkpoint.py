"""DFlash drafters on disk: loading (z-lab's and Speculators' checkpoint layouts, a restricted draft vocabulary),
saving in the z-lab format, the drafters shipped in backend/drafters/ (`--drafter auto`), and a random drafter for
tests and benchmarks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from backend.dflash.model import DFlashDrafter, DrafterConfig

DRAFTERS_DIR = Path(__file__).resolve().parents[1] / "drafters"  # backend/drafters


# ---- checkpoints --------------------------------------------------------------------------------------------------


def read_drafter_config(path: str | Path, *, block_attention: str | None = None) -> DrafterConfig:
    """A drafter folder's config.json, parsed (no weights read). FileNotFoundError without one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    return DrafterConfig.from_json(json.loads(config_file.read_text()), block_attention=block_attention)


def load_drafter(path: str | Path, *, block_attention: str | None = None) -> DFlashDrafter:
    """Load a z-lab DFlash checkpoint directory (config.json + model.safetensors, or sharded with an index).
    Call drafter.check_target(model) (the Engine does) to bind it to the target, on the target's device/dtype."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_drafter_config(path, block_attention=block_attention)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    tensors = {re.sub(r"^(model\.)", "", k): v for k, v in tensors.items()}
    drafter = DFlashDrafter(cfg)
    extra = {k: tensors.pop(k) for k in ("d2t", "t2d", "lm_head.weight", "embed_tokens.weight") if k in tensors}
    if "d2t" in extra:  # Speculators' restricted vocabulary: target id = draft id + d2t[draft id]
        d2t = extra["d2t"].long()
        drafter.restrict_vocab(torch.arange(d2t.shape[0]) + d2t, cfg.vocab_size)
    if "lm_head.weight" in extra:
        drafter.own_head = extra["lm_head.weight"]
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the DFlash layout: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    return drafter.eval()


def save_drafter(drafter: DFlashDrafter, path: str | Path, schema: str = "new") -> Path:
    """Write config.json + model.safetensors in the z-lab format (schema "new" or "old", see DrafterConfig)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if drafter.draft_vocab is not None:
        ids = drafter.draft_vocab.cpu()
        tensors["d2t"] = ids - torch.arange(ids.shape[0])
        tensors["t2d"] = drafter.target_vocab_mask.cpu()
    if drafter.own_head is not None:
        tensors["lm_head.weight"] = drafter.own_head.detach().contiguous().cpu()
    (path / "config.json").write_text(json.dumps(drafter.cfg.to_json(schema), indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"))
    return path


def build_draft_vocab(token_counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent target token ids (ascending), from per-token counts over a corpus."""
    k = min(k, token_counts.shape[0])
    return torch.topk(token_counts.float(), k).indices.sort().values


def random_drafter(target, *, num_layers: int = 1, block_size: int = 8, layer_ids: list[int] | None = None,
                   block_attention: str = "mixed", seed: int = 0) -> DFlashDrafter:
    """An untrained drafter shaped for `target` (benchmarks of the machinery, tests)."""
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    n = tcfg.num_hidden_layers
    if layer_ids is None:  # spread over the target's depth, like the released drafters
        count = min(n, 5)
        layer_ids = sorted({min(n - 1, max(0, round(1 + i * (n - 3) / max(count - 1, 1)))) for i in range(count)})
    heads = tcfg.num_attention_heads
    vocab = target.get_input_embeddings().weight.shape[0]
    cfg = DrafterConfig(
        hidden_size=tcfg.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        intermediate_size=getattr(tcfg, "intermediate_size", None) or 4 * tcfg.hidden_size,
        block_size=block_size, mask_token_id=vocab - 1, target_layer_ids=layer_ids, num_target_layers=n,
        vocab_size=vocab, layer_types=["full_attention"] * num_layers, block_attention=block_attention,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
    )
    gen = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return drafter.eval()


# ---- shipped drafters ---------------------------------------------------------------------------------------------


def _norm_name(name: str) -> str:
    name = name.strip().rstrip("/").split("/")[-1].lower()
    return re.sub(r"\.gguf$", "", name)


def find_shipped_drafter(model_name: str, root: Path = DRAFTERS_DIR) -> Path | None:
    """The drafter shipped under backend/drafters/<name>/ for this target, or None. A drafter matches when its
    `dflash_config.target_model` (or its directory name without a `-dflash` suffix) equals the target's name
    (org prefix and .gguf dropped, case-insensitive) or is a prefix of it followed by '-' (quantization tags)."""
    want = _norm_name(model_name)
    if not want or not root.is_dir():
        return None
    for sub in sorted(root.iterdir()):
        config = sub / "config.json"
        if not config.is_file():
            continue
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            continue
        names = {_norm_name(re.sub(r"-dflash$", "", sub.name, flags=re.I))}
        target = (raw.get("dflash_config") or {}).get("target_model") or raw.get("target_model")
        if target:
            names.add(_norm_name(target))
        if any(want == n or want.startswith(n + "-") or want.startswith(n + ".") for n in names):
            return sub
    return None
