"""What MoE benchmarks do to routing: count the experts a forward wakes, and replace random weights' routing by a
synthetic trace with a real router's locality.

Why a trace: with random weights every token routes uniformly, so a 16-token verify of the Qwen3.6-35B-A3B shape
wakes ~85-103 of 256 experts per layer, where the real router wakes ~48 (the seed's trace): the verify then reads
twice the expert bytes a served model's would, and the benchmark times a verify nobody serves. The trace makes each
layer route among a hot set of experts, as real routers do over a stretch of text.

It routes by position, not by hidden state: position p of any forward of up to max_block tokens takes row
p % PERIOD of a per-layer table of top-k choices from the hot set (random softmax weights). A position is then
routed alike in a decode step and inside any verify block, so speculative output can still be compared with plain
decoding token for token. The model's own routing still runs first (its cost stays in the timing, and on a decode
step it writes the normed rows the experts read); only its choice is replaced. Longer forwards (prefill chunks past
max_block) keep the model's routing.
"""

from __future__ import annotations

import torch

from backend.models.qwen3_5_moe import SparseMoE

PERIOD = 256  # rows of a layer's table: consecutive positions route differently for 256 tokens


def moe_layers(fast) -> list[SparseMoE]:
    return [m for m in fast.model.modules() if isinstance(m, SparseMoE)]


def install_routing_trace(fast, hot: int, seed: int = 0) -> list[torch.Tensor]:
    """Replace the routing of FastModel `fast` by the trace (see the module docstring): per layer, the top-k among
    `hot` experts. The same seed gives every model of the same shape the same trace. Returns the per-layer id tables
    [PERIOD, top_k] (host), for trace_distinct_experts."""
    layers = moe_layers(fast)
    if not layers:
        raise ValueError("a routing trace needs an MoE target")
    experts, k = layers[0].gate_up.shape[0], layers[0].top_k
    if not k <= hot <= experts:
        raise ValueError(f"a routing trace's hot set holds {k}..{experts} experts (top-k to all), got {hot}")
    g = torch.Generator().manual_seed(seed)
    tables, weights = [], []
    for _ in layers:
        hot_set = torch.randperm(experts, generator=g)[:hot]
        tables.append(torch.stack([hot_set[torch.randperm(hot, generator=g)[:k]] for _ in range(PERIOD)]))
        weights.append(torch.softmax(torch.randn(PERIOD, k, generator=g), -1))
    all_ids = torch.stack(tables).to(fast.device)  # [layers, PERIOD, k]
    all_weights = torch.stack(weights).to(fast.device, fast.dtype)
    # this forward's choices for every layer, [layers, tokens, k]: two gathers a forward, captured into the graphs
    # with it (a gather per layer and table cost a decode step 80 launches, ~0.15 ms at the 35B-A3B shape: time no
    # real router spends)
    chosen: dict[str, torch.Tensor] = {}
    model = fast.model
    forward = model.forward

    def forward_noting_positions(tokens, positions, kv_len, **kw):
        if positions.numel() <= fast.max_block:
            rows = torch.remainder(positions, PERIOD)
            chosen["ids"], chosen["weights"] = all_ids[:, rows], all_weights[:, rows]
        return forward(tokens, positions, kv_len, **kw)

    model.forward = forward_noting_positions  # an instance attribute: this model only
    for i, moe in enumerate(layers):
        def traced(h, _i=i, _own=moe.route, **norm):  # the router itself runs too: it norms h for the experts
            routed = _own(h, **norm)
            if h.shape[0] > fast.max_block:
                return routed
            return chosen["weights"][_i], chosen["ids"][_i]
        moe.route = traced
    fast.drop_graphs()  # graphs captured before would replay the model's own routing
    return tables


def route_engine_by_trace(engine, hot: int) -> list[torch.Tensor]:
    """install_routing_trace on an engine's fast path (the benchmarks' --routing-trace); ValueError says why not."""
    if not engine.fast:
        raise ValueError("needs the fast path (an MoE target it covers)")
    return install_routing_trace(engine.target.fast, hot)


def trace_distinct_experts(tables: list[torch.Tensor], tokens: int = 16) -> float:
    """Mean distinct experts a block of `tokens` consecutive positions wakes per layer under the trace."""
    counts = [int(t[(start + torch.arange(tokens)) % PERIOD].unique().numel())
              for t in tables for start in range(PERIOD)]
    return sum(counts) / len(counts)


class ExpertCounter:
    """Counts the distinct routed experts each MoE layer wakes per forward, split by tokens in the forward: through
    forward hooks on transformers' routers, and (watch(engine)) on the fast path's SparseMoE.route."""

    def __init__(self, model):
        self.by_size: dict[int, list[int]] = {}
        self.num_experts = None
        self.handles = []
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k"):
                self.num_experts = getattr(module, "num_experts", None)
                self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        self._count(output[-1])

    def _count(self, indices: torch.Tensor) -> None:
        self.by_size.setdefault(indices.shape[0], []).append(int(indices.unique().numel()))

    def watch(self, engine) -> None:
        """Also count the MoE layers of an engine on the fast path (its own model instance). Not under CUDA graphs:
        counting reads the ids on the host, which a capture forbids, and a replay would not run it anyway."""
        if not engine.fast or engine.target.fast.cuda_graphs:
            return
        for moe in moe_layers(engine.target.fast):
            moe.route = self._counting(moe.route)  # an instance attribute: this engine's model only

    def _counting(self, route):
        def counted(h, **kw):
            weights, ids = route(h, **kw)
            self._count(ids)
            return weights, ids
        return counted

    def mean(self, tokens: int) -> float | None:
        seen = self.by_size.get(tokens)
        return sum(seen) / len(seen) if seen else None

    def close(self):
        for h in self.handles:
            h.remove()
