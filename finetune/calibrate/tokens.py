"""Token folders (`.npy`/`.npz` of input_ids [batch, seq], optionally attention_mask): the next-token
targets a decoder's logits are judged against, and the language-model metrics over them (perplexity,
next-token agreement with float), shared by automatic mixed precision and `finetune evaluate`."""

from __future__ import annotations

import numpy as np
import onnx

IGNORED = -1  # a next-token target no position predicts (the last one, padding)


def next_token_targets(feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """[samples, positions] next-token ids from the feeds' `input_ids` (int64 [batch, seq]): the id
    at t+1 for position t, IGNORED at the last position and wherever attention_mask is 0 at t or t+1
    (padding neither predicts nor is predicted)."""
    targets = []
    for feed in feeds:
        if "input_ids" not in feed or np.ndim(feed["input_ids"]) != 2:
            raise ValueError(f"language-model metrics need an input_ids input of shape [batch, seq]; the feeds hold "
                             f"{sorted(feed)}: give token folders (.npy/.npz of input_ids)")
        ids = np.asarray(feed["input_ids"], dtype=np.int64)
        mask = np.asarray(feed.get("attention_mask", np.ones_like(ids)))[:, -ids.shape[1]:] != 0
        target = np.full(ids.shape, IGNORED, dtype=np.int64)
        kept = mask[:, :-1] & mask[:, 1:]
        target[:, :-1] = np.where(kept, ids[:, 1:], IGNORED)
        targets.append(target)
    return np.concatenate(targets)


def negative_log_likelihoods(logits: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """The negative log-likelihood of each predicted next token, from logits [samples, positions,
    vocabulary] in float64 (log-softmax by log-sum-exp)."""
    kept = _predicted(labels)
    scores = logits[kept].astype(np.float64)
    peak = scores.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(scores - peak).sum(axis=-1)) + peak[:, 0]
    return log_norm - np.take_along_axis(scores, labels[kept][:, None], axis=-1)[:, 0]


def perplexity(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None) -> float:
    """exp(mean negative log-likelihood of each next token) over the predicted positions."""
    return float(np.exp(negative_log_likelihoods(outputs, labels).mean()))


def next_token_agreement(outputs: np.ndarray, float_outputs: np.ndarray, labels: np.ndarray | None) -> float:
    """Share of predicted positions whose argmax next token is the float model's."""
    kept = _predicted(labels)
    return float((outputs[kept].argmax(axis=-1) == float_outputs[kept].argmax(axis=-1)).mean())


def _predicted(labels: np.ndarray | None) -> np.ndarray:
    """The positions a next token is predicted at (targets not IGNORED)."""
    if labels is None:
        raise ValueError("language-model metrics need next-token targets (next_token_targets of the token feeds)")
    return labels != IGNORED


def logits_output_index(model: onnx.ModelProto) -> int:
    """The index of a decoder's logits: the output named `logits`, else its one float output of rank
    3; a one-line error naming the outputs where neither picks one."""
    outputs = list(model.graph.output)
    named = [k for k, out in enumerate(outputs) if out.name == "logits"]
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    rank3 = [k for k, out in enumerate(outputs) if out.type.tensor_type.elem_type in floats
             and out.type.tensor_type.HasField("shape") and len(out.type.tensor_type.shape.dim) == 3]
    found = named or rank3
    if len(found) != 1:
        described = ", ".join(f"{out.name} (rank {len(out.type.tensor_type.shape.dim)})" for out in outputs)
        raise ValueError(f"language-model metrics need the logits output: name it 'logits' or leave one float output of "
                         f"rank 3; the model's outputs are {described}")
    return found[0]
