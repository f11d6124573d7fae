"""A llama2.c checkpoint in numpy: the reference model of kvtier's Python tests
and examples, the same forward pass as the C++ reference engine (model/llama.h).

Attention is a callback, so the same model runs over an in-process full cache
(``FullCacheAttention``) or through kvtier (``kvtier.connector``)::

    m = Llama.load("../shared/models/stories260K.bin")
    attn = FullCacheAttention(m.config)
    logits = m.forward([1, 42, 7], pos=0, attention=attn)   # [3, vocab]
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["Config", "Llama", "FullCacheAttention", "attend"]


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.n_kv_heads


# attention(layer, pos, q [n, n_heads, d], k [n, n_kv_heads, d], v) -> out [n, n_heads, d]
Attention = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# next_layer_query(layer, pos, q_next [n, n_heads, d]): layer + 1's query from
# layer's attention input (InfiniGen speculation), called before `layer` attends.
NextLayerQuery = Callable[[int, int, np.ndarray], None]


class Llama:
    """A llama2.c "legacy" checkpoint (fp32), read with numpy."""

    def __init__(self, config: Config, weights: dict):
        self.config = config
        self.w = weights

    @staticmethod
    def load(path: str) -> "Llama":
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < 28:
            raise ValueError(f"{path}: {len(raw)} bytes is too short for a llama2.c checkpoint")
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = np.frombuffer(raw[:28], "<i4")
        shared = vocab > 0
        vocab = abs(int(vocab))
        c = Config(int(dim), int(hidden), int(layers), int(heads), int(kv_heads), vocab,
                   int(seq_len))
        if c.dim <= 0 or c.n_heads <= 0 or c.dim % c.n_heads or c.n_kv_heads <= 0 \
                or c.n_heads % c.n_kv_heads:
            raise ValueError(f"{path}: not a llama2.c checkpoint (header {c})")
        x = np.frombuffer(raw[28:], "<f4")
        at = 0

        def take(*shape):
            nonlocal at
            n = int(np.prod(shape))
            if at + n > x.size:
                raise ValueError(f"{path}: cut short (needs more than {x.size} floats)")
            a = x[at:at + n].reshape(shape)
            at += n
            return a

        L, d, kv, h = c.n_layers, c.dim, c.kv_dim, c.hidden_dim
        w = {}
        w["embed"] = take(vocab, d)
        w["rms_att"] = take(L, d)
        w["wq"] = take(L, d, d)
        w["wk"] = take(L, kv, d)
        w["wv"] = take(L, kv, d)
        w["wo"] = take(L, d, d)
        w["rms_ffn"] = take(L, d)
        w["w1"] = take(L, h, d)
        w["w2"] = take(L, d, h)
        w["w3"] = take(L, h, d)
        w["rms_final"] = take(d)
        take(c.seq_len, c.head_dim // 2)  # freq_cis_real: RoPE is computed instead.
        take(c.seq_len, c.head_dim // 2)
        w["classifier"] = w["embed"] if shared else take(vocab, d)
        return Llama(c, w)

    def rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        """Rotates [n, heads, d] pairwise (dims 2i, 2i+1) by pos / theta^(2i/d)."""
        d = self.config.head_dim
        n = x.shape[0]
        i = np.arange(0, d, 2, dtype=np.float32)
        freq = (1.0 / self.config.rope_theta ** (i / d)).astype(np.float32)
        ang = (np.arange(pos0, pos0 + n, dtype=np.float32)[:, None] * freq[None, :])
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    @staticmethod
    def rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ss = np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5)
        return (x / np.sqrt(ss)) * w

    def forward(self, tokens: Sequence[int], pos: int, attention: Attention,
                next_layer_query: Optional[NextLayerQuery] = None) -> np.ndarray:
        """Logits [n, vocab] for `tokens` at positions pos..pos+n-1."""
        c, w = self.config, self.w
        n = len(tokens)
        if n == 0:
            raise ValueError("no tokens to run")
        if pos < 0 or pos + n > c.seq_len:
            raise ValueError(f"positions {pos}..{pos + n - 1} outside the model's {c.seq_len}")
        for t in tokens:
            if not 0 <= t < c.vocab_size:
                raise ValueError(f"token id {t} outside vocab {c.vocab_size}")
        x = w["embed"][np.asarray(tokens)].astype(np.float32)
        d = c.head_dim
        for l in range(c.n_layers):
            h = self.rmsnorm(x, w["rms_att"][l])
            q = self.rope((h @ w["wq"][l].T).reshape(n, c.n_heads, d), pos)
            k = self.rope((h @ w["wk"][l].T).reshape(n, c.n_kv_heads, d), pos)
            v = (h @ w["wv"][l].T).reshape(n, c.n_kv_heads, d)
            if next_layer_query is not None and l + 1 < c.n_layers:
                hn = self.rmsnorm(x, w["rms_att"][l + 1])
                qn = self.rope((hn @ w["wq"][l + 1].T).reshape(n, c.n_heads, d), pos)
                next_layer_query(l, pos, qn.astype(np.float32))
            att = attention(l, pos, q.astype(np.float32), k.astype(np.float32),
                            v.astype(np.float32))
            x = x + att.reshape(n, c.dim) @ w["wo"][l].T
            h = self.rmsnorm(x, w["rms_ffn"][l])
            a = h @ w["w1"][l].T
            x = x + ((a / (1.0 + np.exp(-a))) * (h @ w["w3"][l].T)) @ w["w2"][l].T
        return (self.rmsnorm(x, w["rms_final"]) @ w["classifier"].T).astype(np.float32)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, first: int) -> np.ndarray:
    """Causal grouped-query attention of q [n, Hq, d] (positions first..first+n-1)
    over k, v [T, Hkv, d] (positions 0..T-1), in float64."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)  # [T, Hq, d]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("nhd,thd->hnt", q.astype(np.float64), kk) / np.sqrt(d)
    t = np.arange(k.shape[0])
    mask = t[None, :] > (first + np.arange(n))[:, None]  # [n, T]
    s = np.where(mask[None], -np.inf, s)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", p, vv).astype(np.float32)


class FullCacheAttention:
    """Attention over every token so far, in process: the ground truth."""

    def __init__(self, config: Config):
        self.k = [np.zeros((0, config.n_kv_heads, config.head_dim), np.float32)
                  for _ in range(config.n_layers)]
        self.v = [a.copy() for a in self.k]

    def __call__(self, layer: int, pos: int, q, k, v) -> np.ndarray:
        if pos != self.k[layer].shape[0]:
            raise ValueError(f"layer {layer}: position {pos}, but {self.k[layer].shape[0]} "
                             "tokens are cached")
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])
        return attend(q, self.k[layer], self.v[layer], pos)
