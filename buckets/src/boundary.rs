//! Bucket boundaries: whether a bucket may hold parameters of two modules (see [`Boundary`]).

use std::fmt;
use std::str::FromStr;

use crate::ParamSpec;

/// The deepest module key `module:D` accepts: 1,024 name components.
pub const MAX_DEPTH: u32 = 1024;
/// How a module key is derived from a parameter's name (see [`Boundary`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleKey {
    /// The module path through its first all-digit component (the layer index), else its
    /// first component: one module per transformer block.
    Layer,
    /// The first `d` components of the module path (the name without its last component);
    /// `d` is at least 1.
    Depth(u32),
}

/// Where buckets may end (the [`LayoutBuilder::boundary`](crate::LayoutBuilder::boundary)
/// knob; text form of `--bucket-by`): by size alone, or also at every module change.
///
/// Filling buckets by the byte cap alone (in parameter order) puts the tail of one layer and
/// the head of the next into one bucket, so fetching a layer needs two collectives and the
/// shared bucket is gathered once for each of the two layers. FSDP2 issues one all-gather
/// group per `fully_shard` module and DeepSpeed one fetch per submodule; [`Boundary::Module`]
/// gives the same shape here: a new bucket starts wherever the module changes.
///
/// # What a module is
/// A parameter's module is its explicit [`ParamSpec::module`] when given (the `"module"`
/// field of the parameter file), else a key derived from its name by [`ModuleKey`]. Names are
/// dotted paths as PyTorch's `named_parameters()` prints them: the last component is the
/// parameter's own attribute (`weight`, `bias`), the components before it are the **module
/// path** (`h.0.attn.qkv.weight` -> `h.0.attn.qkv`; a name without a dot has the empty path,
/// the root module).
/// - [`ModuleKey::Layer`] (text `module`): the module path through its first component made of
///   digits only (the layer index), else the first component of the path.
///   `h.0.attn.qkv.weight` -> `h.0`; `model.layers.12.mlp.up_proj.weight` -> `model.layers.12`;
///   `transformer.h.3.ln_1.bias` -> `transformer.h.3`; `model.embed_tokens.weight` -> `model`;
///   `lm_head.weight` -> `lm_head`; `w` -> `` (root). One module per transformer block,
///   which is how FSDP2 users wrap models.
/// - [`ModuleKey::Depth`]`(d)` (text `module:D`): the first `d` components of the module path
///   (all of it when it is shorter). Depth 2 of `h.0.attn.qkv.weight` is `h.0`, depth 3 is
///   `h.0.attn`; depth 3 of `model.layers.12.mlp.up_proj.weight` is `model.layers.12`, depth 1
///   is `model`; depth 3 of `transformer.h.3.ln_1.bias` is `transformer.h.3`; depth 2 of
///   `lm_head.weight` is `lm_head`.
///
/// # Rules
/// Parameters are taken in bucketing order (the set's order or
/// [`LayoutBuilder::order`](crate::LayoutBuilder::order)); the module **changes** between two
/// consecutive parameters whose keys differ (a key that comes back later is a new run of that
/// module: buckets follow the order, they never reach back).
/// - Without packing, a module change closes every open bucket (one per dtype): a bucket never
///   holds parameters of two modules.
/// - With packing (`+pack`), a module change keeps the open bucket of a dtype only if the new
///   module has parameters of that dtype and they all fit in it under the cap: consecutive
///   small modules (norms, biases, a tiny head) share a bucket, a bucket holds a run of
///   consecutive whole modules, and a module never straddles two buckets unless its bytes of
///   one dtype exceed the cap by themselves.
/// - Inside a module the cap rules are unchanged: a module larger than the cap is split by the
///   cap, a parameter larger than the cap gets a bucket of its own, each dtype its own bucket.
/// - Gradient buckets follow their gather buckets, as always.
///
/// The cost is O(parameters) (one comparison of two keys per parameter; no allocation per
/// parameter), and the result depends only on the names, modules, sizes and order, so every
/// rank builds the same buckets.
///
/// Text form: `size`, `module` (layer keys), `module:D` (depth `D`), each `module` form with an
/// optional `+pack` (`module+pack`, `module:4+pack`).
///
/// # Examples
/// ```
/// use collsched_buckets::{Boundary, ModuleKey};
/// assert_eq!("module:3+pack".parse::<Boundary>().unwrap(), Boundary::Module { key: ModuleKey::Depth(3), pack: true });
/// assert_eq!("module".parse::<Boundary>().unwrap().to_string(), "module");
/// assert_eq!(Boundary::default().to_string(), "size");
/// assert!("module:0".parse::<Boundary>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Boundary {
    /// Buckets are filled by the byte cap alone, across module boundaries (the default, and
    /// what every layout before this knob did).
    #[default]
    Size,
    /// A new bucket starts where the module changes (see the rules above).
    Module {
        /// How a parameter's module is derived from its name when it names none itself.
        key: ModuleKey,
        /// Let consecutive whole modules share a bucket while they fit under the cap.
        pack: bool,
    },
}

impl Boundary {
    /// Module boundaries with layer keys, no packing (text `module`).
    pub const LAYER: Boundary = Boundary::Module { key: ModuleKey::Layer, pack: false };

    /// The module key of `spec` under `key`: its explicit module, else derived from its name.
    /// A slice of the spec's strings: nothing is allocated.
    pub(crate) fn module_of(spec: &ParamSpec, key: ModuleKey) -> &str {
        if let Some(m) = &spec.module {
            return m;
        }
        let name = &spec.name;
        // The module path: the name without its last component. Every cut below is at a '.'
        // (ASCII), so each slice is on a character boundary. One byte scan, no allocation.
        let path = name.as_bytes()[..name.rfind('.').unwrap_or(0)].as_ref();
        let end = match key {
            ModuleKey::Layer => {
                // Through the first all-digit component, else the first component.
                let mut first = None;
                let mut start = 0;
                loop {
                    let end = path[start..].iter().position(|&b| b == b'.').map_or(path.len(), |i| start + i);
                    let comp = &path[start..end];
                    if !comp.is_empty() && comp.iter().all(u8::is_ascii_digit) {
                        break end;
                    }
                    first.get_or_insert(end);
                    if end == path.len() {
                        break first.unwrap_or(end);
                    }
                    start = end + 1;
                }
            }
            ModuleKey::Depth(d) => {
                // Up to the `d`-th dot of the path, or all of it.
                let mut dots = 0u64;
                path.iter()
                    .position(|&b| {
                        dots += u64::from(b == b'.');
                        b == b'.' && dots >= u64::from(d.max(1))
                    })
                    .unwrap_or(path.len())
            }
        };
        &name[..end]
    }
}

impl fmt::Display for Boundary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Boundary::Size => f.write_str("size"),
            Boundary::Module { key, pack } => {
                f.write_str("module")?;
                if let ModuleKey::Depth(d) = key {
                    write!(f, ":{d}")?;
                }
                if *pack {
                    f.write_str("+pack")?;
                }
                Ok(())
            }
        }
    }
}

impl FromStr for Boundary {
    type Err = ParseBoundaryError;

    /// Parses `size`, `module`, `module:D` (`D` >= 1), optionally followed by `+pack` after a
    /// `module` form.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "size" {
            return Ok(Boundary::Size);
        }
        let (body, pack) = match s.strip_suffix("+pack") {
            Some(b) => (b, true),
            None => (s, false),
        };
        let key = match body {
            "module" => ModuleKey::Layer,
            _ => match body.strip_prefix("module:") {
                Some(d) => match d.parse::<u64>() {
                    Ok(d) if d > 0 && d <= u64::from(MAX_DEPTH) => ModuleKey::Depth(d as u32),
                    Ok(d) if d > 0 => {
                        return Err(ParseBoundaryError::DepthTooLarge {
                            given: s.to_string(),
                            max: MAX_DEPTH,
                        })
                    }
                    _ => return Err(ParseBoundaryError::BadDepth { given: s.to_string() }),
                },
                None => return Err(ParseBoundaryError::Unknown { given: s.to_string() }),
            },
        };
        Ok(Boundary::Module { key, pack })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn key(name: &str, key: ModuleKey) -> String {
        Boundary::module_of(&ParamSpec::new(name, [1], DType::F32), key).to_string()
    }

    #[test]
    fn layer_keys() {
        let l = ModuleKey::Layer;
        assert_eq!(key("h.0.attn.qkv.weight", l), "h.0");
        assert_eq!(key("model.layers.12.mlp.up_proj.weight", l), "model.layers.12");
        assert_eq!(key("transformer.h.3.ln_1.bias", l), "transformer.h.3");
        assert_eq!(key("model.embed_tokens.weight", l), "model");
        assert_eq!(key("lm_head.weight", l), "lm_head");
        assert_eq!(key("block.7.mlp.down.weight", l), "block.7");
        assert_eq!(key("w", l), "");
        // The leaf is never a module component: a ParameterList's entries share a module.
        assert_eq!(key("experts.0", l), "experts");
        assert_eq!(key("a..1.w", l), "a..1");
        assert_eq!(key(".w", l), "");
    }

    #[test]
    fn depth_keys() {
        let d = ModuleKey::Depth;
        assert_eq!(key("h.0.attn.qkv.weight", d(1)), "h");
        assert_eq!(key("h.0.attn.qkv.weight", d(2)), "h.0");
        assert_eq!(key("h.0.attn.qkv.weight", d(3)), "h.0.attn");
        assert_eq!(key("h.0.attn.qkv.weight", d(4)), "h.0.attn.qkv");
        assert_eq!(key("h.0.attn.qkv.weight", d(9)), "h.0.attn.qkv");
        assert_eq!(key("model.layers.12.mlp.up_proj.weight", d(3)), "model.layers.12");
        assert_eq!(key("transformer.h.3.ln_1.bias", d(3)), "transformer.h.3");
        assert_eq!(key("lm_head.weight", d(2)), "lm_head");
        assert_eq!(key("w", d(2)), "");
    }

    #[test]
    fn explicit_module_wins() {
        let p = ParamSpec::new("h.0.attn.qkv.weight", [1], DType::F32).module("shared");
        assert_eq!(Boundary::module_of(&p, ModuleKey::Layer), "shared");
        assert_eq!(Boundary::module_of(&p, ModuleKey::Depth(1)), "shared");
    }

    #[test]
    fn text_round_trips() {
        for s in ["size", "module", "module+pack", "module:1", "module:12+pack"] {
            assert_eq!(s.parse::<Boundary>().unwrap().to_string(), s);
        }
        for s in
            ["", "modules", "module:", "module:0", "module:x", "size+pack", "module:-1", "module+pack+pack"]
        {
            assert!(s.parse::<Boundary>().is_err(), "{s:?}");
        }
    }
}

/// A `--bucket-by` value that is not `size`, `module`, `module:D` (each `module` form with an
/// optional `+pack`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseBoundaryError {
    /// Not one of the known forms.
    #[error("unknown bucket boundary `{given}` (expected size, module or module:DEPTH, a module form optionally with +pack, e.g. module:3+pack)")]
    Unknown {
        /// What was given.
        given: String,
    },
    /// `module:D` with a `D` above [`MAX_DEPTH`] (module paths are never that deep).
    #[error("module depth in `{given}` is above the limit of {max} components (e.g. module:2 keeps `h.0` of `h.0.attn.qkv.weight`)")]
    DepthTooLarge {
        /// What was given.
        given: String,
        /// The limit.
        max: u32,
    },
    /// `module:D` with a `D` that is not a positive integer.
    #[error("bad module depth in `{given}`: D in module:D must be a positive integer (e.g. module:2 keeps `h.0` of `h.0.attn.qkv.weight`)")]
    BadDepth {
        /// What was given.
        given: String,
    },
}
