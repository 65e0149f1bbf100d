//! Workloads: a model's parameters, the order a training step fetches them in, and the FLOPs of
//! each layer; generated for transformers or read from a JSON trace.
//!
//! A [`Workload`] is a list of **layers** (fetch units: `embed`, `block.0` .. `block.{L-1}`,
//! `head`), each naming the parameters it needs and its forward, backward and recompute FLOPs,
//! plus the forward and backward orders in which layers run. Its parameter list is the same
//! JSON shape `collsched plan --params` reads (`{"params": [{"name", "shape", "dtype",
//! "trainable"}]}`).
//!
//! # FLOPs
//! With `T = sequence * batch_per_rank` tokens per rank, a matrix multiply by a `k x n` weight
//! costs `2 T k n` FLOPs forward. A block's forward is its weight multiplies plus attention
//! (`2 T s h` for `Q K^T` and `2 T s h` for attention times `V`, no causal discount), the
//! head's is the vocabulary projection `2 T h V`, the embedding lookup counts 0. Backward is
//! twice forward. With activation checkpointing every block recomputes its forward once during
//! backward (`recompute_flops`); model FLOPs (for TFLOPS per GPU) never count recomputation.
//!
//! # JSON trace format (any other model)
//! ```json
//! {"format": "collsched-workload", "version": 1, "name": "my-model",
//!  "params": [{"name": "w0", "shape": [1024, 1024], "dtype": "bf16", "trainable": true}],
//!  "layers": [{"name": "l0", "params": ["w0"], "forward_flops": 2.1e9,
//!              "backward_flops": 4.2e9, "recompute_flops": 0.0}],
//!  "forward_order": ["l0"], "backward_order": ["l0"],
//!  "loss_flops": 1.0e8, "update_flops": 3.0e8, "hook_s": 2.0e-4, "bucket_order": "params"}
//! ```
//! `loss_flops` (between the forward and the backward) and `update_flops` (after the step's
//! gradients are reduced: the optimizer) are the step's compute outside the layers; `hook_s`
//! the training engine's own host time per layer per step ([`Workload::hook_s`]); each may
//! be left out (0). `bucket_order` ([`BucketOrder`]): `"forward"` (the default) cuts buckets
//! in the order the forward first uses the parameters, `"params"` in the order `params` lists
//! them, the order an engine that builds its layout from its own parameter list cuts them in.
//! A file may instead hold a generator config: `{"format": "collsched-workload", "version": 1,
//! "transformer": {...}}` with the fields of [`TransformerConfig`].

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The `format` tag of workload files.
pub const WORKLOAD_FORMAT: &str = "collsched-workload";
/// The workload file version this library reads and writes.
pub const WORKLOAD_VERSION: u32 = 1;
/// Element types a parameter may have.
pub const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// What went wrong building or reading a workload.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    /// A generator setting is out of range.
    #[error("workload `{workload}`: `{field}` {message}")]
    Config {
        /// The workload's name.
        workload: String,
        /// The setting.
        field: &'static str,
        /// What is wrong and what would do.
        message: String,
    },
    /// A trace is inconsistent (unknown names, empty shapes, bad numbers).
    #[error("workload `{workload}`: {message}")]
    Invalid {
        /// The workload's name.
        workload: String,
        /// What is wrong, naming the parameter or layer.
        message: String,
    },
    /// `--workload NAME` named no preset and no file.
    #[error("unknown workload `{name}`: not a preset ({known}) and not a file")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The preset names.
        known: String,
    },
    /// A file could not be read.
    #[error("workload file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A file is not valid workload JSON.
    #[error("workload JSON {origin}: {message}")]
    Json {
        /// Where the text came from.
        origin: String,
        /// serde_json's message (with line and column) or what is wrong with the header.
        message: String,
    },
}

/// One parameter, as `collsched plan --params` reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRecord {
    /// Unique name (`block.3.attn.qkv.weight`).
    pub name: String,
    /// Shape, every dimension > 0 (PyTorch `Linear` weights are `[out, in]`).
    pub shape: Vec<u64>,
    /// Element type: one of [`DTYPES`].
    pub dtype: String,
    /// Whether it receives gradients.
    pub trainable: bool,
    /// The module it belongs to, when the trace names one (the parameter file's optional
    /// `"module"`); else module boundaries derive it from the name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
}

impl ParamRecord {
    /// Elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// One fetch unit of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// Unique name (`embed`, `block.0`, `head`).
    pub name: String,
    /// Parameters it needs gathered, by name (a tied weight appears in several layers).
    pub params: Vec<String>,
    /// Forward FLOPs per rank per micro-batch.
    pub forward_flops: f64,
    /// Backward FLOPs per rank per micro-batch (recomputation excluded).
    pub backward_flops: f64,
    /// FLOPs recomputed during backward under activation checkpointing (0 without).
    #[serde(default)]
    pub recompute_flops: f64,
    /// Kept fetched from its forward into its backward (`reshard_after_forward=False`;
    /// `collsched.torch`'s root by default): its forward does not release it, and its
    /// backward's fetch finds it gathered (the engine still makes that fetch, which fires the
    /// backward's prefetch rules, and drops the forward's hold). The library's policies; the
    /// `zero3-2021` program ignores it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep: bool,
}

/// A step's parameters, layers and fetch orders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// A short name.
    pub name: String,
    /// Every parameter.
    pub params: Vec<ParamRecord>,
    /// Every layer.
    pub layers: Vec<Layer>,
    /// Layer names in forward order.
    pub forward_order: Vec<String>,
    /// Layer names in backward order.
    pub backward_order: Vec<String>,
    /// Compute per rank per step between the forward and the backward outside every layer
    /// (the loss; 0 where the trace does not say).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub loss_flops: f64,
    /// Compute per rank per step after the step's gradients are reduced, before the next
    /// forward (the optimizer's update, zeroing gradients, the loop's own work; 0 where the
    /// trace does not say).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub update_flops: f64,
    /// Host seconds per layer per step of the training engine's hooks, waits for collectives
    /// left out (`collsched.torch`'s Python hooks and their calls into the library: its
    /// `host_us_per_unit` plus `calls_us_per_unit`), simulated as a quarter at each of the
    /// layer's two fetches and two releases of the library's engine (the `zero3-2021` policy
    /// has hooks of its own); 0 where the trace does not say.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hook_s: f64,
    /// The order the simulated layout takes the parameters in when it cuts buckets.
    #[serde(default, skip_serializing_if = "BucketOrder::is_forward")]
    pub bucket_order: BucketOrder,
}

/// The order a simulated layout takes a workload's parameters in, which decides its buckets
/// and their ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BucketOrder {
    /// The order the forward first uses them (each layer's as it lists them, layers in
    /// `forward_order`): buckets fill in the order their gathers are needed.
    #[default]
    Forward,
    /// The order `params` lists them: the buckets of an engine that builds its layout from
    /// its own parameter list (`collsched.torch` lists them in module order, and its workload
    /// record says `"params"`), ids included, so that `sim --against` pairs each collective with
    /// the same bucket's.
    Params,
}

impl BucketOrder {
    fn is_forward(&self) -> bool {
        *self == BucketOrder::Forward
    }
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

#[derive(Serialize, Deserialize)]
struct WorkloadFile {
    format: String,
    version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    transformer: Option<TransformerConfig>,
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    trace: Option<Workload>,
}

#[derive(Serialize)]
struct ParamsFile<'a> {
    params: &'a [ParamRecord],
}

/// The flavour of transformer, which fixes its parameter layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// GPT-2: learned positions, LayerNorm with bias, biased linears, GELU MLP, final LayerNorm,
    /// output tied to the token embedding.
    Gpt2,
    /// LLaMA: rotary positions (no position table), RMSNorm, no biases, SwiGLU MLP (gate, up,
    /// down), grouped-query attention, final norm, untied output projection.
    Llama,
    /// RoBERTa encoder: learned positions (`sequence + 2` rows), one token type, LayerNorm with
    /// bias, biased linears, GELU MLP, masked-LM head (dense + LayerNorm + bias, decoder tied to
    /// the token embedding); no pooler.
    Roberta,
}

/// The transformer generator's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransformerConfig {
    /// Workload name.
    pub name: String,
    /// Parameter layout.
    pub architecture: Architecture,
    /// Transformer blocks.
    pub layers: u32,
    /// Model width.
    pub hidden: u64,
    /// Attention heads (must divide `hidden`).
    pub heads: u64,
    /// Key/value heads (grouped-query attention; must divide `heads`). Default: `heads`.
    #[serde(default)]
    pub kv_heads: Option<u64>,
    /// MLP inner width. Default: `4 * hidden`.
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    /// Vocabulary size.
    pub vocab: u64,
    /// Sequence length (tokens per sample).
    pub sequence: u64,
    /// Samples per rank per micro-batch.
    pub batch_per_rank: u64,
    /// Recompute each block's forward during backward.
    pub activation_checkpointing: bool,
    /// Parameter element type (`bf16`, `f16`, `f32`).
    pub dtype: String,
}

/// The preset names.
pub const PRESETS: [&str; 5] = ["gpt2-1.5b", "llama-7b", "llama-70b", "roberta-10b", "roberta-50b"];

impl TransformerConfig {
    /// A named preset.
    ///
    /// | name | shape | source |
    /// |---|---|---|
    /// | `gpt2-1.5b` | 48 layers, hidden 1600, 25 heads, vocab 50257, sequence 1024 | GPT-2 XL (Radford et al. 2019; Hugging Face `gpt2-xl` config), 1.56 B parameters |
    /// | `llama-7b` | 32 layers, hidden 4096, 32 heads, MLP 11008, vocab 32000, sequence 2048 | LLaMA 7B (Touvron et al. 2023, table 2), 6.7 B |
    /// | `llama-70b` | 80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 28672, vocab 32000, sequence 4096 | Llama 2 70B (Touvron et al. 2023b; Hugging Face config), 69 B |
    /// | `roberta-10b` | 48 layers, hidden 4096, 32 heads, vocab 53000, sequence 512 | our shape for a RoBERTa-style encoder of about 10 B |
    /// | `roberta-50b` | 64 layers, hidden 8192, 64 heads, vocab 53000, sequence 512 | our shape for a RoBERTa-style encoder of about 52 B |
    ///
    /// GPT-2 and LLaMA presets use batch 8 per rank; RoBERTa presets batch 16 per rank. All use
    /// bf16 and layer-wise activation checkpointing.
    ///
    /// # Errors
    /// [`WorkloadError::Unknown`] listing the presets.
    pub fn preset(name: &str) -> Result<Self, WorkloadError> {
        let base = |architecture, layers, hidden, heads, vocab, sequence, batch_per_rank| TransformerConfig {
            name: name.to_owned(),
            architecture,
            layers,
            hidden,
            heads,
            kv_heads: None,
            ffn_hidden: None,
            vocab,
            sequence,
            batch_per_rank,
            activation_checkpointing: true,
            dtype: "bf16".to_owned(),
        };
        Ok(match name {
            "gpt2-1.5b" => base(Architecture::Gpt2, 48, 1600, 25, 50257, 1024, 8),
            "llama-7b" => TransformerConfig {
                ffn_hidden: Some(11008),
                ..base(Architecture::Llama, 32, 4096, 32, 32000, 2048, 8)
            },
            "llama-70b" => TransformerConfig {
                kv_heads: Some(8),
                ffn_hidden: Some(28672),
                ..base(Architecture::Llama, 80, 8192, 64, 32000, 4096, 8)
            },
            "roberta-10b" => base(Architecture::Roberta, 48, 4096, 32, 53000, 512, 16),
            "roberta-50b" => base(Architecture::Roberta, 64, 8192, 64, 53000, 512, 16),
            _ => return Err(WorkloadError::Unknown { name: name.to_owned(), known: PRESETS.join(", ") }),
        })
    }

    fn check(&self) -> Result<(), WorkloadError> {
        let bad = |field, message: String| {
            Err(WorkloadError::Config { workload: self.name.clone(), field, message })
        };
        for (field, v) in [
            ("layers", u64::from(self.layers)),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("vocab", self.vocab),
            ("sequence", self.sequence),
            ("batch_per_rank", self.batch_per_rank),
        ] {
            if v == 0 {
                return bad(field, "is 0; it must be at least 1".to_owned());
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad("heads", format!("{} does not divide hidden {}", self.heads, self.hidden));
        }
        let kv = self.kv_heads.unwrap_or(self.heads);
        if kv == 0 || !self.heads.is_multiple_of(kv) {
            return bad("kv_heads", format!("{kv} does not divide heads {}", self.heads));
        }
        if self.ffn_hidden == Some(0) {
            return bad("ffn_hidden", "is 0; leave it out for 4 * hidden".to_owned());
        }
        if !DTYPES.contains(&self.dtype.as_str()) {
            return bad("dtype", format!("`{}` is unknown; use one of {}", self.dtype, DTYPES.join(", ")));
        }
        Ok(())
    }

    /// Generates the workload.
    ///
    /// # Errors
    /// [`WorkloadError::Config`] naming a setting that is 0, heads that do not divide hidden,
    /// KV heads that do not divide heads, or an unknown dtype.
    ///
    /// # Examples
    /// ```
    /// use collsched::sim::workload::TransformerConfig;
    /// let w = TransformerConfig::preset("llama-7b")?.workload()?;
    /// assert_eq!(w.forward_order.first().map(String::as_str), Some("embed"));
    /// assert_eq!(w.backward_order.first().map(String::as_str), Some("head"));
    /// assert!((w.param_count() as f64 - 6.74e9).abs() < 0.01e9);
    /// # Ok::<(), collsched::sim::workload::WorkloadError>(())
    /// ```
    pub fn workload(&self) -> Result<Workload, WorkloadError> {
        self.check()?;
        let (h, v) = (self.hidden, self.vocab);
        let kv_dim = h / self.heads * self.kv_heads.unwrap_or(self.heads);
        let ffn = self.ffn_hidden.unwrap_or(4 * h);
        let tokens = (self.sequence * self.batch_per_rank) as f64;
        let arch = self.architecture;
        let biased = arch != Architecture::Llama;
        let mut params = Vec::new();
        let mut add = |name: String, shape: Vec<u64>| {
            params.push(ParamRecord {
                name: name.clone(),
                shape,
                dtype: self.dtype.clone(),
                trainable: true,
                module: None,
            });
            name
        };
        // A matmul weight [out, in] (+ bias [out]) and its forward FLOPs.
        let linear = |add: &mut dyn FnMut(String, Vec<u64>) -> String,
                      names: &mut Vec<String>,
                      prefix: String,
                      out: u64,
                      inp: u64| {
            names.push(add(format!("{prefix}.weight"), vec![out, inp]));
            if biased {
                names.push(add(format!("{prefix}.bias"), vec![out]));
            }
            2.0 * tokens * (out * inp) as f64
        };
        let norm =
            |add: &mut dyn FnMut(String, Vec<u64>) -> String, names: &mut Vec<String>, prefix: String| {
                names.push(add(format!("{prefix}.weight"), vec![h]));
                if biased {
                    names.push(add(format!("{prefix}.bias"), vec![h]));
                }
            };

        let mut layers = Vec::new();
        // Embedding.
        let mut embed = Vec::new();
        embed.push(add("embed.tokens.weight".to_owned(), vec![v, h]));
        match arch {
            Architecture::Gpt2 => {
                embed.push(add("embed.positions.weight".to_owned(), vec![self.sequence, h]))
            }
            Architecture::Roberta => {
                embed.push(add("embed.positions.weight".to_owned(), vec![self.sequence + 2, h]));
                embed.push(add("embed.token_type.weight".to_owned(), vec![1, h]));
                norm(&mut add, &mut embed, "embed.norm".to_owned());
            }
            Architecture::Llama => {}
        }
        let token_embedding = embed[0].clone();
        layers.push(Layer {
            name: "embed".to_owned(),
            params: embed,
            forward_flops: 0.0,
            backward_flops: 0.0,
            recompute_flops: 0.0,
            keep: false,
        });

        // Blocks.
        let attention_flops = 2.0 * 2.0 * tokens * (self.sequence * h) as f64;
        for i in 0..self.layers {
            let p = format!("block.{i}");
            let mut names = Vec::new();
            let mut fwd = attention_flops;
            norm(&mut add, &mut names, format!("{p}.attn_norm"));
            fwd += linear(&mut add, &mut names, format!("{p}.attn.qkv"), h + 2 * kv_dim, h);
            fwd += linear(&mut add, &mut names, format!("{p}.attn.out"), h, h);
            norm(&mut add, &mut names, format!("{p}.mlp_norm"));
            if arch == Architecture::Llama {
                fwd += linear(&mut add, &mut names, format!("{p}.mlp.gate"), ffn, h);
                fwd += linear(&mut add, &mut names, format!("{p}.mlp.up"), ffn, h);
            } else {
                fwd += linear(&mut add, &mut names, format!("{p}.mlp.up"), ffn, h);
            }
            fwd += linear(&mut add, &mut names, format!("{p}.mlp.down"), h, ffn);
            let recompute = if self.activation_checkpointing { fwd } else { 0.0 };
            layers.push(Layer {
                name: p,
                params: names,
                forward_flops: fwd,
                backward_flops: 2.0 * fwd,
                recompute_flops: recompute,
                keep: false,
            });
        }

        // Head.
        let mut head = Vec::new();
        let mut fwd = 2.0 * tokens * (h * v) as f64;
        match arch {
            Architecture::Gpt2 => {
                norm(&mut add, &mut head, "head.norm".to_owned());
                head.push(token_embedding);
            }
            Architecture::Llama => {
                norm(&mut add, &mut head, "head.norm".to_owned());
                head.push(add("head.output.weight".to_owned(), vec![v, h]));
            }
            Architecture::Roberta => {
                fwd += linear(&mut add, &mut head, "head.dense".to_owned(), h, h);
                norm(&mut add, &mut head, "head.dense_norm".to_owned());
                head.push(add("head.output.bias".to_owned(), vec![v]));
                head.push(token_embedding);
            }
        }
        layers.push(Layer {
            name: "head".to_owned(),
            params: head,
            forward_flops: fwd,
            backward_flops: 2.0 * fwd,
            recompute_flops: 0.0,
            keep: false,
        });

        let w = Workload::in_layer_order(&self.name, params, layers);
        w.validate()?;
        Ok(w)
    }
}

impl Workload {
    /// A workload whose forward runs `layers` in their order and whose backward the other way,
    /// with nothing outside the layers (`loss_flops`, `update_flops` and `hook_s` 0). Not
    /// validated: see [`Workload::validate`].
    pub fn in_layer_order(name: &str, params: Vec<ParamRecord>, layers: Vec<Layer>) -> Workload {
        let forward_order: Vec<String> = layers.iter().map(|l| l.name.clone()).collect();
        let backward_order = forward_order.iter().rev().cloned().collect();
        Workload {
            name: name.to_owned(),
            params,
            layers,
            forward_order,
            backward_order,
            loss_flops: 0.0,
            update_flops: 0.0,
            hook_s: 0.0,
            bucket_order: BucketOrder::Forward,
        }
    }

    /// All parameter elements.
    pub fn param_count(&self) -> u64 {
        self.params.iter().map(ParamRecord::numel).sum()
    }

    /// FLOPs of one forward and backward per rank, recomputation excluded (what "model TFLOPS"
    /// counts).
    pub fn model_flops(&self) -> f64 {
        self.layers.iter().map(|l| l.forward_flops + l.backward_flops).sum()
    }

    /// FLOPs actually executed per rank per step: model FLOPs plus recomputation, the loss
    /// and the update.
    pub fn executed_flops(&self) -> f64 {
        self.model_flops()
            + self.layers.iter().map(|l| l.recompute_flops).sum::<f64>()
            + self.loss_flops
            + self.update_flops
    }

    /// A layer by name.
    pub fn layer(&self, name: &str) -> Option<&Layer> {
        self.layers.iter().find(|l| l.name == name)
    }

    /// The parameter list as `collsched plan --params` reads it: `{"params": [...]}`.
    pub fn params_json(&self) -> String {
        serde_json::to_string_pretty(&ParamsFile { params: &self.params }).unwrap_or_default()
    }

    /// The whole trace as JSON (see the module docs).
    pub fn to_json(&self) -> String {
        let file = WorkloadFile {
            format: WORKLOAD_FORMAT.to_owned(),
            version: WORKLOAD_VERSION,
            transformer: None,
            trace: Some(self.clone()),
        };
        serde_json::to_string_pretty(&file).unwrap_or_default()
    }

    /// Reads a workload file: a trace, or a `transformer` generator config.
    ///
    /// # Errors
    /// [`WorkloadError::Json`] for malformed JSON or a wrong header, [`WorkloadError::Config`]
    /// for a bad generator config, [`WorkloadError::Invalid`] for an inconsistent trace.
    pub fn from_json(text: &str) -> Result<Self, WorkloadError> {
        Self::from_json_named(text, "<string>")
    }

    fn from_json_named(text: &str, origin: &str) -> Result<Self, WorkloadError> {
        let json = |message: String| WorkloadError::Json { origin: origin.to_owned(), message };
        let file: WorkloadFile = serde_json::from_str(text).map_err(|e| json(e.to_string()))?;
        if file.format != WORKLOAD_FORMAT {
            return Err(json(format!("`format` is `{}`, expected `{WORKLOAD_FORMAT}`", file.format)));
        }
        if file.version != WORKLOAD_VERSION {
            return Err(json(format!(
                "`version` is {}, this library reads {WORKLOAD_VERSION}",
                file.version
            )));
        }
        match (file.transformer, file.trace) {
            (Some(cfg), None) => cfg.workload(),
            (None, Some(w)) => {
                w.validate()?;
                Ok(w)
            }
            (Some(_), Some(_)) => {
                Err(json("holds both a `transformer` config and a trace; keep one".to_owned()))
            }
            (None, None) => {
                // A trace with a field missing or malformed reads as no trace at all: read it
                // alone to name the field.
                let keys = ["name", "params", "layers", "forward_order", "backward_order"];
                let value: serde_json::Value = serde_json::from_str(text).map_err(|e| json(e.to_string()))?;
                if keys.iter().any(|k| value.get(k).is_some()) {
                    let e = serde_json::from_value::<Workload>(value)
                        .err()
                        .map_or_else(|| "an incomplete trace".to_string(), |e| e.to_string());
                    return Err(json(format!("the trace is incomplete: {e}")));
                }
                Err(json(
                    "holds neither a `transformer` config nor a trace (`name`, `params`, `layers`, \
                     `forward_order`, `backward_order`)"
                        .to_owned(),
                ))
            }
        }
    }

    /// A preset name ([`PRESETS`]) or a workload file.
    ///
    /// # Errors
    /// [`WorkloadError::Unknown`] when `spec` is neither; otherwise as [`Workload::from_json`].
    pub fn resolve(spec: &str) -> Result<Self, WorkloadError> {
        if PRESETS.contains(&spec) || !Path::new(spec).exists() {
            return TransformerConfig::preset(spec)?.workload();
        }
        let text = std::fs::read_to_string(spec)
            .map_err(|source| WorkloadError::Io { path: spec.to_owned(), source })?;
        Self::from_json_named(&text, spec)
    }

    /// Checks names, shapes, dtypes, FLOPs and orders.
    ///
    /// # Errors
    /// [`WorkloadError::Invalid`] naming the first parameter or layer at fault: a repeated or
    /// empty name, a shape with no dimension or a 0 dimension, an unknown dtype, a layer naming an
    /// unknown parameter, FLOPs that are negative or not finite, an order naming an unknown layer
    /// or missing or repeating one.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |message: String| Err(WorkloadError::Invalid { workload: self.name.clone(), message });
        let mut by_name = HashMap::new();
        for p in &self.params {
            if p.name.is_empty() {
                return bad("a parameter has an empty name".to_owned());
            }
            if by_name.insert(p.name.as_str(), p).is_some() {
                return bad(format!("parameter `{}` appears twice", p.name));
            }
            if p.shape.is_empty() || p.shape.contains(&0) {
                return bad(format!(
                    "parameter `{}` has shape {:?}; every dimension must be > 0",
                    p.name, p.shape
                ));
            }
            if !DTYPES.contains(&p.dtype.as_str()) {
                return bad(format!(
                    "parameter `{}` has unknown dtype `{}`; use one of {}",
                    p.name,
                    p.dtype,
                    DTYPES.join(", ")
                ));
            }
        }
        let mut layer_names = BTreeSet::new();
        for l in &self.layers {
            if !layer_names.insert(l.name.as_str()) {
                return bad(format!("layer `{}` appears twice", l.name));
            }
            if let Some(p) = l.params.iter().find(|p| !by_name.contains_key(p.as_str())) {
                return bad(format!("layer `{}` needs unknown parameter `{p}`", l.name));
            }
            for (what, f) in [
                ("forward_flops", l.forward_flops),
                ("backward_flops", l.backward_flops),
                ("recompute_flops", l.recompute_flops),
            ] {
                if !(f.is_finite() && f >= 0.0) {
                    return bad(format!("layer `{}` has {what} = {f}; give a finite number >= 0", l.name));
                }
            }
        }
        for (what, f) in
            [("loss_flops", self.loss_flops), ("update_flops", self.update_flops), ("hook_s", self.hook_s)]
        {
            if !(f.is_finite() && f >= 0.0) {
                return bad(format!("{what} = {f}; give a finite number >= 0"));
            }
        }
        for (what, order) in
            [("forward_order", &self.forward_order), ("backward_order", &self.backward_order)]
        {
            let mut seen = BTreeSet::new();
            for name in order {
                if !layer_names.contains(name.as_str()) {
                    return bad(format!("{what} names unknown layer `{name}`"));
                }
                if !seen.insert(name.as_str()) {
                    return bad(format!("{what} runs layer `{name}` twice"));
                }
            }
            if let Some(missing) = layer_names.iter().find(|n| !seen.contains(*n)) {
                return bad(format!("{what} never runs layer `{missing}`"));
            }
        }
        Ok(())
    }
}
