"""The attention of a `StaticHeadMixedLayer` (rlkv/cache/static/layer.py): the eager prefill and the decode
step (`StaticLayerAttention`, the layer's attention methods), SDPA with a KV head's query group packed as rows
of one head, and the explicit softmax a policy that observes attention needs."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlkv.cache.head_index import merge_heads, pick_heads
from rlkv.cache.static.budget import RowSchedule
from rlkv.cache.static.slots import observe_prompt, write_prompt, written_run


def decode_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query token [B, H_kv * G, 1, D] over keys/values [B, H_kv, S, D], bool mask [B, 1 or H_kv, 1, S]
    (None: every key), the G query heads of a KV head packed as G rows of one SDPA head (every key read
    once). Returns [B, 1, H_kv * G, D]."""
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, 1, heads, dim)


def observed_attention(
    q_comp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token [B, H_c * G, 1, D] over slots [B, H_c, S, D] (valid BoolTensor [B, H_c, S]) with an
    explicit fp32 softmax, as the dynamic cache computes it for a policy that observes attention.
    Returns (output [B, 1, H_c * G, D], probabilities [B, H_c, G, 1, S])."""
    batch, heads, _, dim = q_comp.shape
    kv_heads = keys.shape[1]
    q = q_comp.reshape(batch, kv_heads, heads // kv_heads, 1, dim).float()
    logits = torch.matmul(q, keys[:, :, None].float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, values[:, :, None].float()).to(values.dtype)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), probs


class StaticLayerAttention:
    """The attention methods of `StaticHeadMixedLayer` (a mixin: they read the layer's buffers, head
    indices, form and shared per-request state, as set up by the layer)."""

    # attention ---------------------------------------------------------------------------------------
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Attention output [B, Q, H_q, D] of `query` [B, H_q, Q, D] (post-RoPE) over this layer's storage.

        mask: the model's bool mask [B, 1, Q, max_cache_len] or None (causal, no padding).
        Prefill: one SDPA over the prompt for every head, then the prompt is written to the slots.
        Decode: one SDPA for the full heads over their columns, one for the compressed heads over
        their slots (masked by position >= 0), each with the GQA group packed into one head.
        """
        if self.pending is not None:
            return self._prefill(module, query, mask, scaling)
        b = self.buffers
        outs = []
        # an eager step of an unpadded batch reads what is written, the dynamic cache's shapes; a compiled
        # step (and a padded batch's) reads every slot under a mask, one graph for every step
        starts = self.shared.get("row_starts")  # None until a layer with compressed heads saw a prompt
        unpadded = not torch.compiler.is_compiling() and starts is not None and not any(starts)
        if self.full_idx.numel():
            q_full = pick_heads(query, self.full_q, self.full_q_slice)
            if unpadded:
                keys, values = (b[name].narrow(2, 0, self.host_length) for name in ("full_k", "full_v"))
                outs.append(decode_sdpa(q_full, keys, values, None, scaling))
            elif mask is None:
                cols = torch.arange(self.max_cache_len, device=query.device)
                valid = (cols < b["length"]) & (cols[None, :] >= b["row_start"][:, None])
                outs.append(decode_sdpa(q_full, b["full_k"], b["full_v"], valid[:, None, None, :], scaling))
            else:  # a decode step's mask is one query row already; slicing it would add an op per layer
                full_mask = mask if mask.shape[2] == 1 else mask[:, :, -1:, :]
                outs.append(decode_sdpa(q_full, b["full_k"], b["full_v"], full_mask, scaling))
        if self.comp_idx.numel():
            q_comp = pick_heads(query, self.comp_q, self.comp_q_slice)
            if self.form.observe:
                grouped = q_comp.reshape(q_comp.shape[0], -1, self.num_groups, 1, q_comp.shape[-1])
                if torch.compiler.is_compiling():
                    b["obs_q"].index_copy_(3, ((b["length"] - 1) % self.form.observe).view(1), grouped)
                else:  # the slot is host-known
                    b["obs_q"].narrow(3, (self.host_length - 1) % self.form.observe, 1).copy_(grouped)
            policy = self.settings.policy
            if policy.observe_attention:
                out, probs = observed_attention(q_comp, b["comp_k"], b["comp_v"], b["comp_pos"] >= 0, scaling)
                policy.on_attention(self.slot_view, probs)
                outs.append(out)
            elif unpadded and self.form.kind == "budget" and self.shared_offset is not None:
                lo, hi = written_run(self)
                keys, values = (b[name].narrow(2, lo, hi - lo) for name in ("comp_k", "comp_v"))
                outs.append(decode_sdpa(q_comp, keys, values, None, scaling))
            else:
                comp_mask = (b["comp_pos"] >= 0)[:, :, None, :]
                outs.append(decode_sdpa(q_comp, b["comp_k"], b["comp_v"], comp_mask, scaling))
        if len(outs) == 1:
            return outs[0]
        return merge_heads(outs[0], outs[1], self.full_q, self.full_q_slice, self.comp_q, self.comp_q_slice)

    def _prefill(
        self, module, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        keys, values = self.pending
        self.pending = None
        width = keys.shape[2]
        b = self.buffers
        mask = mask[..., :width] if mask is not None else None
        if mask is None:
            b["row_start"].zero_()
        else:
            real = mask[:, 0].any(dim=1)  # [B, W]: a column some query sees is a real token
            b["row_start"].copy_(torch.where(real.any(1), real.int().argmax(1), width))
        b["length"].fill_(width)
        b["prompt_len"].fill_(width)
        owner = self.layer_idx == self.shared.get("owner")  # the first compressed layer; the others share
        if owner:
            # each row's first real column, read once per request (nothing to read without padding): a
            # ratio budget or an unprotected prompt follows each row's real length, unpadded rows compact
            # one run of slots, and the streaming sink ends at the latest start
            starts = b["row_start"].tolist() if mask is not None else [0] * b["row_start"].shape[0]
            self.shared["row_starts"] = starts
        if self.form.kind == "budget" and self.comp_idx.numel():
            # unpadded rows' eager steps attend the written run (`written_run`), which needs no positions
            observes = self.settings.policy.observe_attention
            self.defer_positions = not observes and not any(self.shared["row_starts"])
            self.policy_state = {}
            self.schedule = self.shared.get("schedule")
            if owner:
                needs_real = self.form.ratio or not self.form.protect
                real = [width - s if needs_real else 0 for s in self.shared["row_starts"]]
                self.schedule = self.shared["schedule"] = RowSchedule(self.form, real)
        if self.form.kind == "streaming" and self.comp_idx.numel():
            # a token at column c >= the prompt width is a sink token only while c < its row's start + sink
            self.sink_until = max(self.shared["row_starts"]) + self.settings.sink
        out = sdpa_attention_forward(module, query, keys, values, mask, scaling=scaling)[0]
        if self.full_idx.numel():
            b["full_k"][:, :, :width].copy_(pick_heads(keys, self.full_idx, self.full_slice))
            b["full_v"][:, :, :width].copy_(pick_heads(values, self.full_idx, self.full_slice))
        if self.comp_idx.numel():
            write_prompt(
                self,
                pick_heads(keys, self.comp_idx, self.comp_slice),
                pick_heads(values, self.comp_idx, self.comp_slice),
            )
            policy = self.settings.policy
            if policy.observe_attention:
                for key, fill in self.slot_fills.items():
                    b[key].fill_(fill)
                if self.form.protect:
                    # the prompt is protected, so its own attention never ranks a candidate; a zero
                    # observation makes the policy create its per-slot buffers here, eagerly
                    comp_pos = b["comp_pos"]
                    zero = torch.zeros(
                        *comp_pos.shape[:2], self.num_groups, 1, comp_pos.shape[2], device=comp_pos.device
                    )
                    policy.on_attention(self.slot_view, zero)
                else:  # an evictable prompt is scored by its own attention, as the dynamic cache does
                    observe_prompt(self, pick_heads(query, self.comp_q, self.comp_q_slice), scaling)
            if self.form.observe:
                q_comp = pick_heads(query, self.comp_q, self.comp_q_slice)
                n = min(width, self.form.observe)
                grouped = q_comp[:, :, width - n :].reshape(
                    q_comp.shape[0], -1, self.num_groups, n, q_comp.shape[-1]
                )
                at = torch.arange(width - n, width, device=query.device) % self.form.observe
                b["obs_q"].index_copy_(3, at, grouped)
            self.compact()  # a prompt over budget now, as the dynamic cache does: not in the first step
        return out
