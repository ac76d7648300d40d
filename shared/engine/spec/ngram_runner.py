"""Speculative decoding without a draft model: n-gram drafts (ngram.py) verified by the
target like a draft model's (runner.SpecRunner.verify), with the same adaptive k.

A draft here is a fixed proposal, not a sample: its distribution q is a point mass, so
speculative sampling accepts it with the target's probability p(x) and otherwise samples
the residual (p without x): lossless for sampled requests too, and greedy output is
token for token plain decoding's. A constrained request's drafts stop before the first
token its grammar refuses, and drafting stops after an EOS or stop token."""
from __future__ import annotations

import torch

from ..scheduler import Scheduled
from .adapt import AdaptiveK
from .ngram import propose
from .runner import SpecRunner


class NgramRunner(SpecRunner):
    def __init__(self, engine):     # not super().__init__: that one loads a draft model
        self.engine = engine
        self.cfg = engine.cfg
        self.draft = None
        self.catch_up = 0
        self.adapt = AdaptiveK.for_runner(self)
        self.stale_s = 0.0

    def propose(self, batch: list[Scheduled]) -> None:
        V = self.engine.model_cfg.vocab_size
        for s in batch:
            if not s.k:
                continue
            seq = s.seq
            req = self.engine.requests[seq.request_id]
            drafts = propose(seq.prompt_ids + seq.output_ids, s.k)
            grammar = req.constraint.fork() if req.constraint is not None and drafts else None
            stop = req.proc.eos_ids | set(seq.params.stop_token_ids)
            kept = []
            for t in drafts:
                if not 0 <= t < V or (grammar is not None and not grammar.accept(t)):
                    break
                kept.append(t)
                if t in stop or (grammar is not None and grammar.is_terminated):
                    break
            s.drafts = kept
            s.draft_probs = None
            if kept and not seq.params.greedy:      # q: a point mass on each draft
                s.draft_probs = torch.zeros(len(kept), V)
                s.draft_probs[torch.arange(len(kept)), torch.tensor(kept)] = 1.0
