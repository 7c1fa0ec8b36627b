"""The VLA model's modules: a ViT encoder, a rotary GQA decoder and a flow-matching action expert.

See :mod:`dmuon.bench.models` for the architecture in words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VLASize:
    """Dimensions of the VLA benchmark model."""

    image_size: int
    """Input image side in pixels (square RGB images)."""

    patch: int
    """Patch side in pixels; ``image_size`` must be a multiple of it."""

    dv: int
    """Vision encoder width."""

    vision_layers: int
    """Number of ViT blocks."""

    vision_heads: int
    """Attention heads of the ViT blocks (``dv`` must be divisible by it)."""

    vision_mlp: int
    """MLP width of the ViT blocks."""

    dl: int
    """Language decoder width."""

    lm_layers: int
    """Number of decoder blocks."""

    lm_heads: int
    """Query heads of the decoder."""

    lm_kv_heads: int
    """Key/value heads of the decoder."""

    lm_head_dim: int
    """Head dimension of the decoder (even, for rotary embeddings)."""

    lm_mlp: int
    """MLP width of the decoder."""

    vocab: int
    """Vocabulary size."""

    text_len: int
    """Text tokens per sample."""

    da: int
    """Action expert width."""

    expert_layers: int
    """Number of action-expert blocks."""

    expert_heads: int
    """Query heads of the action expert."""

    expert_kv_heads: int
    """Key/value heads of the action expert."""

    expert_head_dim: int
    """Head dimension of the action expert (even, for rotary embeddings)."""

    expert_mlp: int
    """MLP width of the action expert."""

    action_horizon: int
    """Action tokens (time steps of the predicted action chunk) per sample."""

    action_dim: int
    """Dimension of one action vector."""

    state_dim: int
    """Dimension of the proprioceptive state vector."""

    batch_size: int
    """Samples per rank per step."""

    @property
    def image_tokens(self) -> int:
        """Number of image patches per sample."""
        return (self.image_size // self.patch) ** 2


def _rope(seq_len: int, head_dim: int, device: torch.device,
          dtype: torch.dtype, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding cos/sin tables of shape ``(seq_len, head_dim)``."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies rotary embeddings to ``x`` of shape ``(B, heads, S, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _GQAttention(nn.Module):
    """Grouped-query attention with separate q/k/v/o projections."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # Heads from the width: under tensor parallelism a rank holds a slice of them.
        b, s, _ = x.shape
        return x.view(b, s, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, kv_input: torch.Tensor | None = None, *,
                q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                k_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attends from ``x`` to ``kv_input`` (``x`` itself when ``None``).

        Args:
            x: Queries' input, ``(B, Sq, width)``.
            kv_input: Keys'/values' input, ``(B, Skv, width)``.
            q_rope: Rotary cos/sin tables applied to the queries.
            k_rope: Rotary cos/sin tables applied to the keys.
            mask: Boolean ``(Sq, Skv)`` mask, ``True`` where attention is allowed.

        Returns:
            ``(B, Sq, width)``.
        """
        kv_input = x if kv_input is None else kv_input
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(kv_input))
        v = self._split(self.v_proj(kv_input))
        if q_rope is not None:
            q = _apply_rope(q, *q_rope)
        if k_rope is not None:
            k = _apply_rope(k, *k_rope)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _ViTBlock(nn.Module):
    """SigLIP-style pre-LayerNorm ViT block (biased projections, GELU MLP)."""

    def __init__(self, dv: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dv, eps=1e-6)
        self.attn = _GQAttention(dv, heads, heads, dv // heads, bias=True)
        self.norm2 = nn.LayerNorm(dv, eps=1e-6)
        self.fc1 = nn.Linear(dv, mlp)
        self.fc2 = nn.Linear(mlp, dv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class _DecoderBlock(nn.Module):
    """Pre-RMSNorm decoder block: rotary GQA self-attention plus SwiGLU MLP."""

    def __init__(self, dl: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(dl, eps=1e-6)
        self.self_attn = _GQAttention(dl, heads, kv_heads, head_dim, bias=False)
        self.post_attn_norm = nn.RMSNorm(dl, eps=1e-6)
        self.mlp = _SwiGLU(dl, mlp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), q_rope=rope, k_rope=rope, mask=mask)
        return x + self.mlp(self.post_attn_norm(x))


class _ExpertBlock(nn.Module):
    """Action-expert block attending to projected decoder context and itself.

    The decoder's final hidden states (width ``dl``) are projected to the
    expert width ``da`` by ``context_proj``; the action tokens' queries then
    attend to the concatenation ``[context, action tokens]`` (rotary embeddings
    only on the action tokens, no mask), followed by a SwiGLU MLP.
    """

    def __init__(self, dl: int, da: int, heads: int, kv_heads: int, head_dim: int,
                 mlp: int) -> None:
        super().__init__()
        self.context_proj = nn.Linear(dl, da, bias=False)
        self.context_norm = nn.RMSNorm(da, eps=1e-6)
        self.input_norm = nn.RMSNorm(da, eps=1e-6)
        self.attn = _GQAttention(da, heads, kv_heads, head_dim, bias=False)
        self.post_attn_norm = nn.RMSNorm(da, eps=1e-6)
        self.mlp = _SwiGLU(da, mlp)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ctx = self.context_norm(self.context_proj(context))
        h = self.input_norm(x)
        kv = torch.cat([ctx, h], dim=1)
        cos, sin = rope
        n_ctx = ctx.shape[1]
        # Identity rotation on the context keys, rotary on the action keys.
        k_cos = torch.cat([torch.ones_like(cos[:1]).expand(n_ctx, -1), cos], dim=0)
        k_sin = torch.cat([torch.zeros_like(sin[:1]).expand(n_ctx, -1), sin], dim=0)
        x = x + self.attn(h, kv, q_rope=rope, k_rope=(k_cos, k_sin))
        return x + self.mlp(self.post_attn_norm(x))


def _sinusoidal(t: torch.Tensor, dim: int, min_period: float = 4e-3,
                max_period: float = 4.0) -> torch.Tensor:
    """Sinusoidal embedding of flow-matching times ``t`` (``(B,)``) into ``(B, dim)``."""
    frac = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** frac
    angle = t.float()[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(t.dtype)


class VLAModel(nn.Module):
    """Pi0-like vision-language-action model (see :mod:`dmuon.bench.models`).

    Forward order: patch embedding, ``vision_blocks``, projector, ``lm_blocks``
    (prefix-LM mask: image tokens attend bidirectionally among themselves, text
    tokens causally), ``expert_blocks`` on ``[state token, action tokens]``.

    Args:
        cfg: Model dimensions.
    """

    def __init__(self, cfg: VLASize) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(3, cfg.dv, kernel_size=cfg.patch, stride=cfg.patch)
        self.vision_pos = nn.Embedding(cfg.image_tokens, cfg.dv)
        self.vision_blocks = nn.ModuleList(
            _ViTBlock(cfg.dv, cfg.vision_heads, cfg.vision_mlp) for _ in range(cfg.vision_layers)
        )
        self.vision_norm = nn.LayerNorm(cfg.dv, eps=1e-6)
        self.projector = nn.Linear(cfg.dv, cfg.dl)
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dl)
        self.lm_blocks = nn.ModuleList(
            _DecoderBlock(cfg.dl, cfg.lm_heads, cfg.lm_kv_heads, cfg.lm_head_dim, cfg.lm_mlp)
            for _ in range(cfg.lm_layers)
        )
        self.lm_norm = nn.RMSNorm(cfg.dl, eps=1e-6)
        self.lm_head = nn.Linear(cfg.dl, cfg.vocab, bias=False)
        self.state_proj = nn.Linear(cfg.state_dim, cfg.da)
        self.action_in_proj = nn.Linear(cfg.action_dim, cfg.da)
        self.action_time_mlp_in = nn.Linear(2 * cfg.da, cfg.da)
        self.action_time_mlp_out = nn.Linear(cfg.da, cfg.da)
        self.expert_blocks = nn.ModuleList(
            _ExpertBlock(cfg.dl, cfg.da, cfg.expert_heads, cfg.expert_kv_heads,
                         cfg.expert_head_dim, cfg.expert_mlp)
            for _ in range(cfg.expert_layers)
        )
        self.expert_norm = nn.RMSNorm(cfg.da, eps=1e-6)
        self.action_out_proj = nn.Linear(cfg.da, cfg.action_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialises weights: normal(0, 0.02) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    @property
    def blocks(self) -> list[nn.Module]:
        """All ViT, decoder and expert blocks, in forward order."""
        return [*self.vision_blocks, *self.lm_blocks, *self.expert_blocks]

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, state: torch.Tensor,
                noisy_actions: torch.Tensor, time: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the model.

        Args:
            images: ``(B, 3, image_size, image_size)``.
            input_ids: ``(B, text_len)`` token ids.
            state: ``(B, state_dim)``.
            noisy_actions: ``(B, action_horizon, action_dim)``.
            time: ``(B,)`` flow-matching times in ``(0, 1]``.

        Returns:
            ``(text_logits, velocity)``: ``(B, text_len, vocab)`` next-token
            logits over the text positions and ``(B, action_horizon,
            action_dim)`` predicted flow velocities.
        """
        cfg = self.cfg
        # Vision encoder.
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = x + self.vision_pos.weight[None]
        for block in self.vision_blocks:
            x = block(x)
        img = self.projector(self.vision_norm(x))
        # Language decoder over [image tokens, text tokens].
        h = torch.cat([img, self.embed_tokens(input_ids)], dim=1)
        n_img, seq = img.shape[1], h.shape[1]
        pos = torch.arange(seq, device=h.device)
        mask = (pos[None, :] <= pos[:, None]) | (pos[None, :] < n_img)
        rope = _rope(seq, cfg.lm_head_dim, h.device, h.dtype)
        for block in self.lm_blocks:
            h = block(h, rope, mask)
        h = self.lm_norm(h)
        logits = self.lm_head(h[:, n_img:])
        # Action expert over [state token, action tokens].
        t_emb = _sinusoidal(time, cfg.da).to(noisy_actions.dtype)
        a = self.action_in_proj(noisy_actions)
        t_emb = t_emb[:, None, :].expand(-1, a.shape[1], -1)
        a = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, t_emb], -1))))
        z = torch.cat([self.state_proj(state)[:, None, :], a], dim=1)
        expert_rope = _rope(z.shape[1], cfg.expert_head_dim, z.device, z.dtype)
        for block in self.expert_blocks:
            z = block(z, h, expert_rope)
        velocity = self.action_out_proj(self.expert_norm(z)[:, 1:])
        return logits, velocity
