"""What each config key means, in one sentence, for the generated config reference. Types, defaults
and allowed values come from the dataclasses (config_ref.py); only the meaning is written here. A
key without a sentence still appears in the reference, with the code's own comment if it has one."""

from __future__ import annotations

from finetune.config import STEP_GROUP

DESCRIPTIONS: dict[str, str] = {
    # QuantConfig: the top level
    "QuantConfig.preset": "Start from this preset (or YAML file) and deep-merge the rest of the mapping over it.",
    "QuantConfig.activation": "Format of the activation inputs of quantized nodes; null leaves them float.",
    "QuantConfig.weight": "Format of the weights of quantized nodes; null leaves them float.",
    "QuantConfig.bias": "`auto`: int32 when activations and weights are both INT (scale s_input * s_weight), else float.",
    "QuantConfig.op_types": "Op types whose nodes are quantized, or `all`.",
    "QuantConfig.op_type_overrides": "Formats per op type (layer-wise mixed precision).",
    "QuantConfig.node_overrides": "Formats per node name; wins over op_type_overrides.",
    "QuantConfig.tensor_overrides": "Format per tensor name (null: leave it float); wins over everything but exclude_nodes.",
    "QuantConfig.exclude_nodes": "Node names or full-match regular expressions left in float.",
    "QuantConfig.dual_quant": "Where a tensor's producer quantizes it in another format than its reader, keep both quantizers (Quark's dual quant node pairs).",
    "QuantConfig.fold_batch_norm": "Fold each BatchNormalization into the Conv or Gemm before it first (as Quark's FoldBatchNorm and onnxruntime's optimiser do); the folded float graph is the tuning reference.",
    "QuantConfig.cross_layer_equalization": "Rescale Conv pairs joined through Relu, Clip or Pad to equal channel ranges first.",
    "QuantConfig.smooth_quant": "SmoothQuant of the quantized MatMul / Gemm / Conv inputs before quantizing (see Configs); null: off.",
    "SmoothQuant.alpha": "How much of each input channel's range moves into the weights: s = max|X|^alpha / max|W|^(1 - alpha).",
    "SmoothQuant.op_types": "The layer op types whose inputs are smoothed (of MatMul, Gemm, Conv).",
    "SmoothQuant.fold": "Fold 1/s into the input's producer where that is exact; false: always a Mul before the layers.",
    "QuantConfig.awq": "AWQ-style activation-aware scaling of MatMul / Gemm inputs, searched against the weights' own format (see Configs); null: off. Not with smooth_quant.",
    "AWQ.grid": "How many alphas are tried: 0, 1/grid, ..., (grid - 1)/grid in s = mean|X|^alpha (normalised); alpha 0 is rounding to nearest.",
    "AWQ.op_types": "The layer op types whose inputs are scaled (of MatMul, Gemm).",
    "AWQ.fold": "Fold 1/s into the input's producer where that is exact; false: always a Mul before the layers.",
    "AWQ.output_layers": "Scale layers that write a model output (an LM head) too; off by default: on SmolLM2 it cost next-token agreement.",
    "QuantConfig.weight_storage": "`float`: float initializers read through QDQ; `compact`: weights stored as codes.",
    "QuantConfig.bf16_as_cast": "Write the final model's bfloat16 quantize-dequantize pairs as Cast pairs.",
    "QuantConfig.npu_cnn": "Apply the Vitis AI / Ryzen AI NPU constraints for CNNs (see the NPU page).",
    "QuantConfig.fast_finetune": "Recover accuracy after quantizing (AdaRound / AdaQuant / GPTQ); null: no tuning.",
    "QuantConfig.auto_mixed_precision": "Search per-layer precision against a target (see Automatic mixed precision).",
    # FormatChoice
    "FormatChoice.format": "The format family: `int`, `float` (bfloat16, float16, float8), `bfp` (BFP and MX4/6/9), `mx` (OCP MX).",
    "FormatChoice.dtype": "Element type of `int` and `float` formats.",
    "FormatChoice.symmetric": "`int`: zero point 0 (signed) or the middle code (unsigned).",
    "FormatChoice.granularity": "`int`/`float`: one scale per tensor, per channel, or per block of `block_size`.",
    "FormatChoice.axis": "The channel or block axis; `auto` picks the op's output channels (scales) or its reduction axis (blocks).",
    "FormatChoice.block_size": "Elements per block (`int` blocks, BFP, MX).",
    "FormatChoice.power_of_two": "`int`: scales restricted to powers of two.",
    "FormatChoice.saturate": "`float`: values beyond the type's largest finite value clamp to it.",
    "FormatChoice.calibration": "How scales are chosen: `minmax` (the only one for blocks), `percentile`, `mse`, `pot_minmse`, `entropy`.",
    "FormatChoice.percentile": "The percentile of |x| kept with `calibration: percentile`.",
    "FormatChoice.bfp_method": "`to_bfp` (BFP16) or `to_bfp_prime` (MX4/MX6/MX9, with sub-block shifts).",
    "FormatChoice.bit_width": "BFP bits per element including the shared exponent's share (16 for BFP16 and MX9, 13 MX6, 11 MX4).",
    "FormatChoice.sub_block_size": "`to_bfp_prime`: elements per sub-block sharing a shift.",
    "FormatChoice.sub_block_shift_bits": "`to_bfp_prime`: bits of each sub-block's shift.",
    "FormatChoice.rounding_mode": "0 half away from zero, 1 half toward +inf, 2 half to even (MX int8 and BFP).",
    "FormatChoice.convert_to_bfloat_before_bfp": "1: round to bfloat16 before BFP.",
    "FormatChoice.element_dtype": "`mx`: the element type of OCP Microscaling.",
    # Override
    "Override.activation": "The activation format for this op type or node (unset: the global one; null: float).",
    "Override.weight": "The weight format (unset: the global one; null: float).",
    "Override.bias": "The bias format (unset: the global one).",
    # FastFinetune
    "FastFinetune.algorithm": "AdaRound learns the rounding of INT weights; AdaQuant trains the weights through the fake quantizer; GPTQ rounds them in one pass, spreading each error over the rest.",
    "FastFinetune.iterations": "Optimisation steps per unit (early stopping may end a unit sooner); 0: bias correction alone.",
    "FastFinetune.lr": "Learning rate; null takes the default of the algorithm and the weight's format family (a measured "
                       "table, see Learning rate); `auto` scales that table by a factor a short seeded search on the first "
                       "tuned unit picks by its held-out loss.",
    "FastFinetune.batch_size": "Rows per optimisation step.",
    "FastFinetune.data_size": "Use at most this many calibration samples (null: all).",
    "FastFinetune.early_stop": "When a unit stops improving, finish its schedule in a tail (see Fine-tuning).",
    "FastFinetune.seed": "Seed of batch order, QDrop and initialisation: same inputs and seed give the same bytes.",
    "FastFinetune.device": "Where tuning runs.",
    "FastFinetune.op_types": "Op types whose weights are tuned.",
    "FastFinetune.include_output_quant": "Unit layer only: include the quantizer of the layer's output in its unit.",
    "FastFinetune.drop_ratio": "QDrop: share of unit inputs taken from the quantized model rather than the float one.",
    "FastFinetune.cache_budget_bytes": "Cached activations kept in memory; the rest spill to files in $TMPDIR.",
    "FastFinetune.device_cache_bytes": "On an accelerator: a unit's training rows copied to it up to this size.",
    "FastFinetune.unit": "`layer`: one weight layer at a time; `block`: the layers of one exporter scope together (BRECQ).",
    "FastFinetune.deterministic": "`true`: only deterministic kernels; `warn`: run anyway with a warning.",
    "FastFinetune.allow_tf32": "Let CUDA use TF32 matrix products (faster, not float32-exact).",
    "FastFinetune.devices": "Processes tuning data-parallel per machine, one device each.",
    "FastFinetune.nodes": "Machines of a data-parallel run.",
    "FastFinetune.strategy": "Lightning Fabric strategy of a data-parallel run (`ddp`, `ddp_spawn`, `ddp_fork`, ...).",
    "FastFinetune.validation_share": "Share of the calibration batches held out of training (drawn with the seed): early stopping "
                                     "reads each unit's loss there, measured every few steps, and the unit ends at its lowest; "
                                     "units are kept on their loss there, and the tuned model must not be further from float there than the "
                                     "untuned one (else its weights come back); 0: none held out.",
    "FastFinetune.gptq": "GPTQ's settings (algorithm `gptq`, or `gptq_init`).",
    "FastFinetune.gptq_init": "Start AdaRound or AdaQuant from GPTQ's weights.",
    "FastFinetune.compile": "Run the quantize-dequantize kernels through torch.compile (same bits); `auto`: where a compiler "
                            "is at hand, `true`: fail without one, `false`: eager.",
    "FastFinetune.threads": "torch's intra-op threads while tuning on the CPU. `auto`: one thread for a unit whose step "
                            "is too small to gain from more, else the CPUs of this process (affinity, cgroup quota) that "
                            "other jobs leave free, chosen per unit; a number pins it (as OMP_NUM_THREADS does), and "
                            "with it the last bits of the tuned weights.",
    "FastFinetune.gradient_pieces": "Pieces a step's batch is cut into (rows of calibration batch c in piece c modulo this), "
                                    "each piece's gradient computed alone and the pieces added in order; `auto`: one per "
                                    "process. N processes take the steps of one process with `gradient_pieces: N` bit for "
                                    "bit, on any CPU.",
    "FastFinetune.bias_correction": "Add each layer's mean float-minus-quantized output error per channel (training rows) to "
                                    "its bias before and after tuning, kept where the held-out loss does not rise "
                                    "(Quark: `BiasCorrection`); `auto`: on alone (iterations 0), with AdaRound and GPTQ, off with AdaQuant and for weights stored as "
                                    "codes without a float model (measured).",
    "FastFinetune.adaquant": "What AdaQuant trains beside the weights (algorithm `adaquant` only; the keys were top-level "
                             "`fast_finetune` keys before, which are still read, with a warning).",
    # AdaQuant
    "AdaQuant.update_bias": "Train the bias too.",
    "AdaQuant.learn_scales": "`weights` learns the scale (and an asymmetric zero point) of each tuned "
                                 "INT weight with LSQ's gradient (power-of-two scales stay powers of two), `activations` "
                                 "those of the INT activation quantizers inside each unit, `all` both; written into "
                                 "the QDQ graph, int32 biases re-quantized to them.",
    "AdaQuant.learn_equalization": "Learn a per-channel scale between two layers of a unit that only ReLU, "
                                       "max pooling and activation quantizers separate (equalisation for block formats), "
                                       "folded into both layers' float weights.",
    "AdaQuant.scale_lr": "Adam learning rate of the learned log-scales (`learn_scales`), decaying with AdaQuant's.",
    "GPTQ.perc_damp": "Share of the Hessian's mean diagonal added to its diagonal.",
    "GPTQ.block_size": "Columns per lazy batch update (changes only the order of the arithmetic).",
    "GPTQ.act_order": "Round the columns of largest input power first.",
    # EarlyStop
    "EarlyStop.enabled": "Stop units early.",
    "EarlyStop.patience": "Steps without improvement before the tail starts: of the held-out loss (its measurements over "
                          "that many steps) where batches are held out, else of the "
                          f"{STEP_GROUP}-step mean training loss.",
    "EarlyStop.min_delta": "The improvement that counts.",
    "EarlyStop.warmup": "Steps before stopping is considered.",
    # AutoMixedPrecision
    "AutoMixedPrecision.ladder": "The rungs: presets or {activation, weight, bias} formats, or a split ladder.",
    "AutoMixedPrecision.target": "The metric value the final model must reach.",
    "AutoMixedPrecision.max_drop": "Or: how far below the float model's metric it may fall.",
    "AutoMixedPrecision.keep_top": "Or: exactly this many most sensitive layers stay at the top rung.",
    "AutoMixedPrecision.lower": "Or: exactly this many least sensitive layers take the bottom rung.",
    "AutoMixedPrecision.metric": "`l2`, `cosine`, `top1_agreement`, `top1_accuracy` or `module:function`.",
    "AutoMixedPrecision.target_op_types": "Op types whose nodes the search moves.",
    "AutoMixedPrecision.granularity": "`layer`: a layer's input and weight move together; `tensor`: each on its own ladder.",
    "AutoMixedPrecision.output_index": "Which model output the metric reads.",
    "AutoMixedPrecision.finetune_in_loop": "Tune each candidate (loop_iterations per unit) before judging it.",
    "AutoMixedPrecision.loop_iterations": "Iterations per unit when tuning inside the search.",
    "AutoMixedPrecision.evaluation_data": "A folder to judge on (null: the calibration data).",
    "AutoMixedPrecision.keep_high": "Node names, tensors they read, or indices held at the top rung.",
    "AutoMixedPrecision.exclude": "Node names, tensors or indices left to the config's own formats.",
    "AutoMixedPrecision.costs": "Bits weight per node or op type (default 1).",
    # SplitLadder
    "SplitLadder.activation": "The activation rungs.",
    "SplitLadder.weight": "The weight rungs.",
}

# AMD Quark option names: how each translated option lands in a finetune config (quark_ref.py)
QUARK_NOTES: dict[str, str] = {
    "quant_format": "QDQ forms are what we write; `BFPFixNeuron` / `MXFixNeuron` force QBFP / QMX types (a given type is then ignored, at WARNING)",
    "calibrate_method": "`calibration` (and `power_of_two`) of INT and float8 formats; see the values below",
    "activation_type": "`activation` (format and dtype; QBFP / QMX read `BFPAttributes` / `MXAttributes`)",
    "weight_type": "`weight`, as activation_type",
    "op_types_to_quantize": "`op_types` (empty: our defaults); must agree with `OpTypesToQuantize`",
    "extra_op_types_to_quantize": "added to `op_types`",
    "nodes_to_exclude": "`exclude_nodes` (exact names or full-match regular expressions)",
    "per_channel": "weights `granularity: channel` (INT and float8 only)",
    "include_fast_ft": "turns the `FastFinetune` block into `fast_finetune` (without it the block has no effect, at WARNING)",
    "include_auto_mp": "turns the `AutoMixprecision` block on (see Automatic mixed precision)",
    "include_cle": "`cross_layer_equalization: true` (our sweeps, not Quark's single step)",
    "optimize_model": "default of `FoldBatchNorm` (Quark's default: true); onnxruntime's other graph rewrites are not run, as finetune keeps the float graph op by op",
    "FoldBatchNorm": "`fold_batch_norm` (default: optimize_model, itself true by default)",
    "include_sq": "`smooth_quant: {alpha: SmoothAlpha}` (MatMul, Gemm and Conv inputs)",
    "include_rotation": "`rotation: {}` (a randomised Hadamard rotation of a decoder's residual stream, folded into its weights)",
    "specific_tensor_precision": "turns `MixedPrecisionTensor` on",
    "enable_npu_cnn": "`npu_cnn: true`; needs a PowerOfTwoMethod",
    "enable_dpu": "former name of enable_npu_cnn",
    "extra_options": "read option by option (next table)",
    "ActivationSymmetric": "`activation.symmetric` (default: true with power-of-two methods or CalibTensorRangeSymmetric)",
    "WeightSymmetric": "`weight.symmetric` (default true)",
    "CalibTensorRangeSymmetric": "default of ActivationSymmetric",
    "Percentile": "`percentile` with the percentile method (else no effect, at WARNING)",
    "WeightCalibrateMethod": "the weights' `calibration` (default: minmax with float scales)",
    "Int32Bias": "true (default): int32 biases; false on INT weights is refused (a bias is int32, float or its weight's float format)",
    "QuantizeBias": "false: `bias: float`",
    "BFPAttributes": "the keys of `format: bfp`",
    "MXAttributes": "the keys of `format: mx`",
    "RefineBlockAxis": "activation blocks on the op's reduction axis (`axis: auto`) instead of Quark's axis 1",
    "MixedPrecisionTensor": "`tensor_overrides` {tensor: format}, with specific_tensor_precision",
    "TensorQuantOverrides": "`tensor_overrides`, one entry per tensor (per-channel lists refused)",
    "AutoMixprecision": "`auto_mixed_precision` (with include_auto_mp)",
    "EnableDualQuantNodePairs": "`dual_quant`",
    "FastFinetune": "`fast_finetune` (with include_fast_ft); BatchSize defaults to Quark's 1",
    "UseGPTQ": "GPTQ on the weights of MatMul nodes, activations float, as in Quark: `fast_finetune: {algorithm: gptq, op_types: [MatMul]}`, or `gptq_init: true` with include_fast_ft",
    "GPTQParams": "GPTQ's settings (with UseGPTQ; without it no effect, at WARNING); next table",
    "UseMatMulNBits": "weight-only 4-bit groups on MatMul weights written as MatMulNBits: `weight: {dtype: int4 or uint4, "
                      "granularity: block, block_size: GroupSize}`, `op_types: [MatMul]`, `weight_storage: matmul_nbits`, "
                      "activations float (activation_type and weight_type then have no effect, at WARNING, as in Quark)",
    "MatMulNBitsParams": "the MatMulNBits settings (with UseMatMulNBits; without it no effect, at WARNING); table below",
    "GroupSize": "Quark's integer groups have no equivalent for its weight types: only -1 (none) is accepted",
    "SmoothAlpha": "`smooth_quant.alpha` (with include_sq; default 0.5, as Quark's)",
    "OpTypesToQuantize": "`op_types`, as op_types_to_quantize",
    "ExtraOpTypesToQuantize": "added to `op_types`",
    "QuantizeAllOpTypes": "`op_types: all`",
    "WeightsOnly": "`activation: null`",
    "AddQDQPairToWeight": "true (default): `weight_storage: float`; false: `compact`",
    "BiasCorrection": "`fast_finetune.bias_correction` (ours corrects before and after tuning); true without fast finetune: "
                      "`fast_finetune: {iterations: 0, bias_correction: true}`, the correction alone, as Quark runs it",
    "BF16QDQToCast": "`bf16_as_cast: true` (applied after tuning)",
    "AlignConcat": "accepted as true with enable_npu_cnn and false without: npu_cnn always aligns these scales",
    "AlignPool": "as AlignConcat",
    "AlignPad": "as AlignConcat",
    "AlignSlice": "as AlignConcat",
    "EarlyStop": "`fast_finetune.early_stop.enabled`",
    "InferDevice": "checked; unit inputs come from torch on the fast_finetune device, so another value is named at WARNING",
    "OptimAlgorithm": "lower-cased",
    "TargetOpType": "`target_op_types` of the search (in AutoMixprecision) or `op_types` (in FastFinetune)",
    "TargetQuantType": "the lower rung's activation and weight types",
    "ActTargetQuantType": "the lower rung's activation type",
    "WeightTargetQuantType": "the lower rung's weight type",
    "BiasTargetQuantType": "the lower rung's bias",
    "DualQuantNodes": "`dual_quant`",
    "OutputIndex": "`output_index`",
    "L2Target": "`metric: l2` with that `target`",
    "Top1AccTarget": "an accuracy drop: `max_drop` on `top1_accuracy` (labels) or on EvaluateFunction",
    "EvaluateFunction": "`metric: module:function`",
    "NumTarget": "`lower: N`",
    "TargetTensors": "`keep_high` (refused where the target types are the cheaper ones)",
    "TargetIndices": "`keep_high` by index",
    "ExcludeIndices": "`exclude`",
    "AutoMixUseFastFT": "`finetune_in_loop`",
    "quant_type": "the tensor's format",
    "axis": "`axis` (INT and float: per channel)",
    "symmetric": "`symmetric`",
    "ForceQuantizeNoInputCheck": "we quantize the inputs of every selected op, which true asks for; false has no equivalent",
    "NumBatches": "one batch per step, as Quark's default",
}

# extra_options.MatMulNBitsParams keys -> what each becomes (finetune/config/quark_nbits.py checks the values)
QUARK_NBITS_NOTES = {
    "GroupSize": "`weight.block_size` along each MatMul weight's reduction axis; a power of two of at least 16 (default 128)",
    "Symmetric": "true (default): int4 with MatMulNBits' default zero point 8; false: uint4 with a zero point per group",
    "Bits": "4 only (default): finetune packs 4-bit MatMulNBits",
    "AccuracyLevel": "0 (default) or 1: float32 accumulation, which finetune's nodes ask for; 2-4 are refused",
    "Algorithm": "DEFAULT (round to nearest, min/max scales) or GPTQ (`fast_finetune: {algorithm: gptq}` with "
                 "GPTQParams); HQQ is refused",
}
