"""A model's KV cache layer by layer: what each layer keeps and the bytes of one block of it.

vLLM 0.33 asks every attention layer for a KV-cache spec (`get_kv_cache_spec` in
vllm/model_executor/layers/attention/attention.py, chunked_local_attention.py, mla_attention.py
and mamba/abstract.py) and sizes pages with the spec classes of vllm/v1/kv_cache_interface.py.
This module gives the same list, one `LayerKV` a layer, on one tensor-parallel rank:

- full attention, sliding window W, chunked local attention C (`FullAttentionSpec`,
  `SlidingWindowSpec`, `ChunkedLocalAttentionSpec`): a page is block_size tokens of K and V for
  the rank's KV heads, `AttentionSpec.page_size_bytes` = KV heads x block_size x
  (head_size + head_size_v) x dtype bytes; a rank holds max(1, KV heads / tp) heads;
- MLA (`MLAAttentionSpec`): one "head" of kv_lora_rank + qk_rope_head_dim and no separate V,
  on every rank alike;
- a gated-delta-net (Mamba-style) layer (`MambaSpec`): one page holds one sequence's state, the
  conv state and the recurrent state, in the model's dtype (`mamba_cache_dtype` and
  `mamba_ssm_cache_dtype` "auto", mamba_utils.py `_mamba_state_dtype`), whatever
  `--kv-cache-dtype` says.

`--kv-cache-dtype fp8` stores attention K/V (and MLA's latent) in one byte an element.

How a model sits in the blocks: one whose layers are all alike keeps one group (exact). One that
mixes full attention with sliding-window or chunked-local layers keeps vLLM's hybrid KV-cache
groups (`hybrid_layout`, `kvcache.hybrid`) where vLLM on a CUDA host turns its hybrid manager on
(`hybrid_on`), and otherwise the fallback, `place`: vLLM's `--disable-hybrid-kv-cache-manager`
(kv_cache_planning.py `_promote_local_kv_cache_specs`: every layer keeps every token's K/V, the
window still bounds what attention reads). One with Mamba-state layers has no such fallback in
vLLM: its groups always (`hybrid_layout` raises the attention block size until an attention page
holds a Mamba state, as vLLM's `_align_hybrid_block_size` does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm

from kvsim.kvcache.groups import GroupSpec
from kvsim.sim.engine.catalog import ConfigError, ModelSpec

# what a layer keeps, in the order a summary names them
KINDS = ("full", "sliding_window", "chunked_local", "mla", "mamba")
KIND_WORDS = {"full": "full attention", "sliding_window": "sliding window", "chunked_local": "chunked local",
              "mla": "MLA latent", "mamba": "state-space (Mamba or gated-delta-net) state", "none": "feed-forward only (no cache)"}


@dataclass(frozen=True)
class LayerKV:
    """One layer's KV cache on one rank: its kind (`KINDS`), the window of a sliding-window
    layer or the chunk of a chunked-local one, and the bytes of one page (block_size tokens; a
    Mamba-state layer: one sequence's state)."""

    kind: str
    window: int | None
    page_bytes: int

    def describe(self) -> str:
        words = KIND_WORDS[self.kind]
        return f"{words} {self.window:,}" if self.window else words


NO_CACHE = LayerKV("none", None, 0)  # a layer with no attention and no state (Nemotron-H's MLP and MoE layers)


def kv_layers(model: ModelSpec, tp: int = 1, block_size: int = 16, kv_dtype_bytes: int | None = None) -> tuple[LayerKV, ...]:
    """Every layer's `LayerKV`, in layer order (see the module docstring)."""
    dt = kv_dtype_bytes or model.dtype_bytes
    if model.mla:
        mla = LayerKV("mla", None, block_size * (model.kv_lora_rank + model.qk_rope_head_dim) * dt)
        return (mla,) * model.num_layers
    page = block_size * model.kv_elements_per_token_layer(tp) * dt
    state = 0
    if model.linear_conv_kernel:  # conv state in the model's dtype, the recurrent state in its own
        conv, ssm = model.linear_state_shapes(tp)
        state = _prod(conv) * model.dtype_bytes + _prod(ssm) * (model.state_dtype_bytes or model.dtype_bytes)
    by_type = {
        "full_attention": LayerKV("full", None, page),
        "sliding_attention": LayerKV("sliding_window", model.sliding_window, page),
        "chunked_attention": LayerKV("chunked_local", model.attention_chunk_size, page),
        "linear_attention": LayerKV("mamba", None, state),
        "mlp": NO_CACHE, "moe": NO_CACHE,
    }
    return tuple(by_type[model.layer_type(i)] for i in range(model.num_layers))


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layer_counts(layers: tuple[LayerKV, ...]) -> list[tuple[LayerKV, int]]:
    """Identical specs merged, with how many layers each has, in order of first appearance; layers
    that keep nothing are left out."""
    counts: dict[LayerKV, int] = {}
    for layer in layers:
        if layer.kind != "none":
            counts[layer] = counts.get(layer, 0) + 1
    return list(counts.items())


def describe_layers(layers: tuple[LayerKV, ...]) -> str:
    """'62 layers: 52 sliding window 1,024, 10 full attention, 16,384 bytes a block each'."""
    counts = layer_counts(layers)
    parts = [f"{n} {layer.describe()}" for layer, n in counts]
    bare = sum(1 for layer in layers if layer.kind == "none")
    parts += [f"{bare} {NO_CACHE.describe()}"] if bare else []
    pages = sorted({layer.page_bytes for layer, _ in counts})
    if len(pages) == 1:
        each = f"{pages[0]:,} bytes a page each"
    else:
        each = "; ".join(f"{layer.describe()} {layer.page_bytes:,} bytes a page" for layer, _ in counts)
    return f"{len(layers)} layers: {', '.join(parts)}; {each}"


@dataclass(frozen=True)
class Placement:
    """How a model's layers sit in kvsim's one group of blocks: the window the block manager
    enforces (None: every token kept), and `approximation`, a sentence when the placement is
    vLLM's fallback rather than its default."""

    window: int | None
    approximation: str | None


def place(model: ModelSpec, layers: tuple[LayerKV, ...]) -> Placement:
    """See the module docstring; ConfigError for a model with Mamba-state layers among others."""
    counts = layer_counts(layers)
    kinds = {layer.kind for layer, _ in counts}
    if len(counts) == 1 and counts[0][0].kind not in ("chunked_local", "mamba"):
        only = counts[0][0]
        return Placement(only.window if only.kind == "sliding_window" else None, None)
    if "mamba" in kinds:
        raise ConfigError(
            f"model {model.name}: {describe_layers(layers)}. vLLM keeps state-space state in KV-cache groups of "
            "its own beside attention's, in one pool, and has no fallback without them: "
            "--disable-hybrid-kv-cache-manager cannot run this model")
    approx = (f"{model.name} mixes {', '.join(f'{n} {layer.describe()}' for layer, n in counts)} layers, kept as "
              "vLLM keeps them with its hybrid KV-cache manager off (--disable-hybrid-kv-cache-manager; vLLM's "
              "default for chunked local attention): every layer keeps every token's K/V in one group, so blocks "
              "are fewer than its hybrid groups give; attention still reads only each layer's window")
    return Placement(None, approx)


def hybrid_on(model: ModelSpec, layers: tuple[LayerKV, ...], disable: bool | None, chunked_local: bool) -> bool:
    """Whether vLLM 0.33 on a CUDA host runs `model` with its hybrid KV-cache manager
    (vllm/config/vllm.py `VllmConfig.__post_init__`'s hybrid-manager rules): `disable` is
    `--disable-hybrid-kv-cache-manager` (True), `--no-disable-...` (False: asked for) or unset
    (None: vLLM decides); `chunked_local` is VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1.
    Unset, it is on, except for a model with chunked local attention (its latency regression)
    without that variable; asked for where vLLM would turn it off: ConfigError, as vLLM's
    ValueError. Only a model mixing layer kinds has more than one group either way."""
    if disable:
        return False  # (a model with Mamba-state layers has no fallback: `place` refuses it)
    needs_off = any(layer.kind == "chunked_local" for layer in layers) and not chunked_local
    if disable is False and needs_off:
        raise ConfigError(f"model {model.name}: vLLM turns the hybrid KV-cache manager off for chunked local "
                          "attention unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 "
                          "(hybrid_chunked_local), and refuses it when asked for")
    return not needs_off


@dataclass(frozen=True)
class Group:
    """One KV-cache group of vLLM's hybrid manager: layers of one spec sharing a block table.
    A group holding fewer layers than the layout's group size is padded (its pages unused)."""

    layer: LayerKV
    layers: tuple[int, ...]

    def spec(self, block_size: int) -> GroupSpec:
        """The block manager's spec of this group (`kvcache.groups`)."""
        kind = "full" if self.layer.kind == "mla" else self.layer.kind
        return GroupSpec(kind, block_size, self.layer.window if kind not in ("full", "mamba") else None)


@dataclass(frozen=True)
class HybridLayout:
    """How vLLM 0.33's hybrid KV-cache manager (its default on CUDA) groups a model's layers, and
    the bytes one block of its shared pool takes on a rank (group size x page)."""

    groups: tuple[Group, ...]
    group_size: int
    bytes_per_block: int
    block_size: int | None = None  # the attention block size raised for Mamba state (None: as configured)
    mamba_page_bytes: int = 0  # a Mamba state's own bytes, before padding to the page
    # the Mamba layers' prefill checkpoint grid (vLLM's MambaSpec.prefill_checkpoint_alignment: the
    # block size where they export a mid-prefill state, FlashInfer's gated delta net); None: none
    checkpoint_alignment: int | None = None

    @property
    def has_mamba(self) -> bool:
        return any(g.layer.kind == "mamba" for g in self.groups)

    @property
    def num_state_groups(self) -> int:
        """The Mamba groups: a NIXL read or hold of a request has one state block in each."""
        return sum(1 for g in self.groups if g.layer.kind == "mamba")

    @property
    def state_read_bytes(self) -> int:
        """The bytes one rank's NIXL read moves for one Mamba group's block: the conv and SSM state of
        each layer slot holding a Mamba layer, not the padded page (vLLM 0.33 nixl/base_worker.py
        `_build_mamba_local`: a region a conv sub-projection plus the SSM region, sized by
        ssm_conv_transfer_utils.py `derive_mamba_conv_split`'s `ssm_sizes`, in each of
        `_ssm_region_indices`; every group's layer i shares slot i, kv_cache_planning.py
        `get_kv_cache_config_from_groups`). 0 without Mamba groups."""
        slots = max((len(g.layers) for g in self.groups if g.layer.kind == "mamba"), default=0)
        return slots * self.mamba_page_bytes

    def table(self, block_size: int) -> list[dict]:
        """One record a group, in vLLM's group order: its kind, window, layers, block size and the
        bytes one block of it takes (the pool's block: every group's is the same size)."""
        bs = self.block_size or block_size
        return [{"group": i, "kind": g.layer.kind, "window": g.layer.window, "layers": list(g.layers),
                 "block_size": bs, "bytes_per_block": self.bytes_per_block}
                for i, g in enumerate(self.groups)]

    def describe(self) -> str:
        kinds: dict[LayerKV, int] = {}
        for g in self.groups:
            kinds[g.layer] = kinds.get(g.layer, 0) + 1
        parts = [f"{n} {layer.describe()}" for layer, n in kinds.items()]
        return (f"{len(self.groups)} groups of {self.group_size} layers ({', '.join(parts)}), "
                f"{self.bytes_per_block:,} bytes a block")


def mamba_block_size(layers: tuple[LayerKV, ...], block_size: int, checkpoint_alignment: int | None) -> int:
    """The block size vLLM 0.33 gives a model with Mamba-state layers beside attention
    (vllm/platforms/interface.py `Platform._align_hybrid_block_size`): the least multiple of the
    kernel alignment whose attention page holds the largest Mamba state, rounded to the attention
    kernel's 16 tokens; the configured size if that is larger. The kernel alignment is
    max(16, block_size), made a multiple of the layers' prefill checkpoint alignment in align mode
    (FlashInfer's gated-delta-net prefill: 64; `checkpoint_alignment` None: 1). `layers` are sized
    at `block_size`."""
    per_token = max(x.page_bytes for x in layers if x.kind not in ("mamba", "none")) // block_size
    state = max(x.page_bytes for x in layers if x.kind == "mamba")
    align = lcm(max(16, block_size), checkpoint_alignment or 1)
    size = align * -(-state // (align * per_token))
    size = 16 * -(-size // 16)
    return max(size, block_size)


def hybrid_layout(layers: tuple[LayerKV, ...], name: str = "this model", block_size: int = 16,
                  checkpoint_alignment: int | None = None) -> HybridLayout:
    """vLLM 0.33's grouping (vllm/v1/core/kv_cache_planning.py `get_kv_cache_groups`, then
    `_get_kv_cache_groups_uniform_page_size`) of attention layers whose pages are one size:

    - layers with equal specs form a bucket, buckets in order of first appearance;
    - the group size is the smallest bucket's layer count, or the largest's when that is below
      1.5 times the smallest (fewer padding layers);
    - a bucket of n layers becomes cdiv(n, size) groups, group i taking layers[i::groups]
      (interleaved), the last ones padded;
    - one block of the shared pool holds a page of every layer of a group: size x page bytes.

    A model whose layers are all alike has one group of every layer. With Mamba-state layers the
    block size is raised (`mamba_block_size`, `layers` sized at `block_size`) and each state padded
    to the attention page (`mamba_page_size_padded`), so every page is one size. Other mixed page
    sizes: ConfigError."""
    if any(layer.kind == "mamba" for layer in layers) and len(layer_counts(layers)) > 1:
        raised = mamba_block_size(layers, block_size, checkpoint_alignment)
        page = max(x.page_bytes for x in layers if x.kind not in ("mamba", "none")) // block_size * raised
        padded = tuple(x if x.kind == "none" else replace(x, page_bytes=page) for x in layers)
        state = max(x.page_bytes for x in layers if x.kind == "mamba")
        return replace(_uniform_layout(padded, name), block_size=raised, mamba_page_bytes=state,
                       checkpoint_alignment=raised if checkpoint_alignment else None)
    return _uniform_layout(layers, name)


def _uniform_layout(layers: tuple[LayerKV, ...], name: str) -> HybridLayout:
    """`hybrid_layout` of layers whose pages are one size (ConfigError otherwise)."""
    counts = layer_counts(layers)

    if len(counts) == 1:
        only, n = counts[0]
        return HybridLayout((Group(only, tuple(i for i, x in enumerate(layers) if x == only)),), n, n * only.page_bytes)
    if len({layer.page_bytes for layer, _ in counts}) > 1:
        raise ConfigError(f"model {name}: {describe_layers(layers)}; grouping pages of different sizes "
                          "(vLLM's page unification) is not modelled yet")
    buckets = {layer: [i for i, x in enumerate(layers) if x == layer] for layer, _ in counts}  # (never "none")
    smallest, largest = min(map(len, buckets.values())), max(map(len, buckets.values()))
    size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for layer, idx in buckets.items():
        n = -(-len(idx) // size)
        groups += [Group(layer, tuple(idx[i::n])) for i in range(n)]
    return HybridLayout(tuple(groups), size, size * counts[0][0].page_bytes)
