//! Parameters: [`ParamSpec`], the ordered [`ParamSet`] and its JSON file format.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

use crate::DType;

/// Dense index of a parameter in its [`ParamSet`] (its position in the list).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub u32);

impl ParamId {
    /// The id as an index into per-parameter arrays.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ParamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One parameter of a model: name, shape, element type, and whether it takes gradients.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Unique name (e.g. `h.0.attn.qkv.weight`).
    pub name: String,
    /// Dimensions; empty for a scalar. Every dimension is at least 1.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// `requires_grad`: frozen parameters (`false`) take no part in gradient buckets.
    pub trainable: bool,
    /// The module the parameter belongs to, when the engine names it (e.g. the path of the
    /// `fully_shard`-wrapped block, `model.layers.12`). `None` (the default): derived from the
    /// name when the layout asks for module boundaries (see
    /// [`Boundary`](crate::Boundary)). Only bucket boundaries depend on it.
    pub module: Option<String>,
}

impl ParamSpec {
    /// A trainable parameter.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, ParamSpec};
    /// let p = ParamSpec::new("w", [4, 8], DType::F32);
    /// assert_eq!(p.numel(), Some(32));
    /// assert!(p.trainable);
    /// ```
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        ParamSpec { name: name.into(), shape: shape.into(), dtype, trainable: true, module: None }
    }

    /// The same parameter with `trainable` set.
    #[must_use]
    pub fn trainable(mut self, trainable: bool) -> Self {
        self.trainable = trainable;
        self
    }

    /// The same parameter in an explicitly named module (see [`module`](Self::module)).
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, ParamSpec};
    /// let p = ParamSpec::new("shared.w", [8], DType::F32).module("model.layers.3");
    /// assert_eq!(p.module.as_deref(), Some("model.layers.3"));
    /// ```
    #[must_use]
    pub fn module(mut self, module: impl Into<String>) -> Self {
        self.module = Some(module.into());
        self
    }

    /// Number of elements (product of the shape, 1 for a scalar), or `None` on overflow.
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

#[derive(Debug)]
struct Inner {
    specs: Vec<ParamSpec>,
    numels: Vec<usize>,
    index: HashMap<String, ParamId>,
}

/// An ordered list of parameters with unique names, validated: every dimension is at least 1
/// and every byte size fits the address space.
///
/// Cloning is cheap (shared).
#[derive(Clone, Debug)]
pub struct ParamSet {
    inner: Arc<Inner>,
}

impl PartialEq for ParamSet {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.inner.specs == other.inner.specs
    }
}

impl Eq for ParamSet {}

impl ParamSet {
    /// Validates a parameter list.
    ///
    /// # Errors
    /// [`ParamError`] naming the parameter: empty list, empty or duplicate name, an empty
    /// module name, a zero dimension, a size that overflows, more than `u32::MAX` parameters.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, ParamSet, ParamSpec};
    /// let set = ParamSet::new(vec![ParamSpec::new("a", [3], DType::F32)]).unwrap();
    /// assert_eq!(set.len(), 1);
    /// assert!(ParamSet::new(vec![ParamSpec::new("a", [0, 3], DType::F32)]).is_err());
    /// ```
    pub fn new(specs: Vec<ParamSpec>) -> Result<ParamSet, ParamError> {
        if specs.is_empty() {
            return Err(ParamError::Empty);
        }
        if u32::try_from(specs.len()).is_err() {
            return Err(ParamError::TooMany { count: specs.len() });
        }
        let mut index = HashMap::with_capacity(specs.len());
        let mut numels = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            if s.name.is_empty() {
                return Err(ParamError::EmptyName { index: i });
            }
            if s.module.as_deref() == Some("") {
                return Err(ParamError::EmptyModule { name: s.name.clone() });
            }
            if let Some(dim) = s.shape.iter().position(|&d| d == 0) {
                return Err(ParamError::ZeroDim { name: s.name.clone(), shape: s.shape.clone(), dim });
            }
            // Bound numel so that padded offsets and byte counts of any bucket stay far from
            // overflow: at most 2^48 elements (256 TiB of f64) per parameter.
            let numel = s.numel().filter(|&n| n as u64 <= 1 << 48 && n.checked_mul(s.dtype.size()).is_some());
            let Some(numel) = numel else {
                return Err(ParamError::TooLarge {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    dtype: s.dtype,
                });
            };
            numels.push(numel);
            // Position fits u32: checked above.
            let id = ParamId(i as u32);
            if let Some(prev) = index.insert(s.name.clone(), id) {
                return Err(ParamError::DuplicateName {
                    name: s.name.clone(),
                    first: prev.index(),
                    second: i,
                });
            }
        }
        Ok(ParamSet { inner: Arc::new(Inner { specs, numels, index }) })
    }

    /// Parses and validates a parameter file:
    /// `{"params": [{"name": "w", "shape": [3072, 1024], "dtype": "bf16", "trainable": true,
    /// "module": "h.0"}, ...]}`. `trainable` defaults to `true`; `module` is optional (see
    /// [`ParamSpec::module`]; without it a module is derived from the name when the layout
    /// asks for module boundaries); unknown keys are errors (a misspelt `trainable` must not
    /// silently default).
    ///
    /// # Errors
    /// [`ParamFileError::Json`] with line and column for malformed JSON or a wrong shape,
    /// [`ParamFileError::UnknownDType`] naming the parameter, [`ParamFileError::Param`] for
    /// anything [`ParamSet::new`] rejects.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::ParamSet;
    /// let set = ParamSet::from_json(r#"{"params": [{"name": "w", "shape": [2, 2], "dtype": "bf16"}]}"#).unwrap();
    /// assert_eq!(set.numel(set.id("w").unwrap()), 4);
    /// let err = ParamSet::from_json("{\"params\": [}").unwrap_err();
    /// assert!(err.to_string().contains("line 1 column 13"));
    /// ```
    pub fn from_json(text: &str) -> Result<ParamSet, ParamFileError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            params: Vec<Entry>,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Entry {
            name: String,
            shape: Vec<usize>,
            dtype: String,
            #[serde(default = "yes")]
            trainable: bool,
            #[serde(default)]
            module: Option<String>,
        }
        fn yes() -> bool {
            true
        }
        // A UTF-8 byte order mark (some editors write one) is not part of the JSON.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if text.trim_start().starts_with('[') {
            return Err(ParamFileError::Json {
                line: 1,
                column: 1,
                message: "the file is a JSON array; the parameters go in an object: {\"params\": [...]}"
                    .into(),
            });
        }
        let file: File = serde_json::from_str(text).map_err(|e| {
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
            ParamFileError::Json { line: e.line(), column: e.column(), message }
        })?;
        let mut specs = Vec::with_capacity(file.params.len());
        for (index, e) in file.params.into_iter().enumerate() {
            let dtype = match e.dtype.parse::<DType>() {
                Ok(d) => d,
                Err(_) => return Err(ParamFileError::UnknownDType { name: e.name, index, dtype: e.dtype }),
            };
            specs.push(ParamSpec {
                name: e.name,
                shape: e.shape,
                dtype,
                trainable: e.trainable,
                module: e.module,
            });
        }
        Ok(ParamSet::new(specs)?)
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.inner.specs.len()
    }

    /// Always `false`: a set holds at least one parameter.
    pub fn is_empty(&self) -> bool {
        self.inner.specs.is_empty()
    }

    /// All parameters, in order (index = [`ParamId`]).
    pub fn specs(&self) -> &[ParamSpec] {
        &self.inner.specs
    }

    /// All ids, in order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = ParamId> + '_ {
        (0..self.inner.specs.len() as u32).map(ParamId)
    }

    /// The parameter with this id, if any.
    pub fn get(&self, id: ParamId) -> Option<&ParamSpec> {
        self.inner.specs.get(id.index())
    }

    /// The id of the parameter with this name, if any.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.inner.index.get(name).copied()
    }

    /// The name of a parameter (`"?"` for an id outside the set).
    pub fn name(&self, id: ParamId) -> &str {
        self.get(id).map_or("?", |s| s.name.as_str())
    }

    /// Element count of a parameter (0 for an id outside the set).
    pub fn numel(&self, id: ParamId) -> usize {
        self.inner.numels.get(id.index()).copied().unwrap_or(0)
    }

    /// Element counts of all parameters, by id.
    pub fn numels(&self) -> &[usize] {
        &self.inner.numels
    }

    /// Whether a parameter is trainable (`false` for an id outside the set).
    pub fn is_trainable(&self, id: ParamId) -> bool {
        self.get(id).is_some_and(|s| s.trainable)
    }

    /// The `requires_grad` mask, by id.
    pub fn trainable_mask(&self) -> Vec<bool> {
        self.inner.specs.iter().map(|s| s.trainable).collect()
    }

    /// The same parameters with a new trainability mask (one entry per parameter, by id).
    ///
    /// # Errors
    /// [`ParamError::MaskLength`] if the mask length is not [`len`](Self::len).
    pub fn with_trainable(&self, mask: &[bool]) -> Result<ParamSet, ParamError> {
        if mask.len() != self.len() {
            return Err(ParamError::MaskLength { got: mask.len(), expected: self.len() });
        }
        if self.inner.specs.iter().zip(mask).all(|(s, &m)| s.trainable == m) {
            return Ok(self.clone());
        }
        let specs = self
            .inner
            .specs
            .iter()
            .zip(mask)
            .map(|(s, &m)| ParamSpec { trainable: m, ..s.clone() })
            .collect();
        Ok(ParamSet {
            inner: Arc::new(Inner {
                specs,
                numels: self.inner.numels.clone(),
                index: self.inner.index.clone(),
            }),
        })
    }
}

/// Why a parameter list was rejected by [`ParamSet::new`](crate::ParamSet::new).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    /// The list holds no parameters.
    #[error("the parameter list is empty: give at least one parameter")]
    Empty,
    /// A parameter without a name.
    #[error("parameter #{index} has an empty name: every parameter needs a unique name")]
    EmptyName {
        /// Position in the list.
        index: usize,
    },
    /// A parameter whose explicit module name is empty.
    #[error("parameter `{name}` has an empty module name: leave `module` out (it is then derived from the name) or name the module, e.g. \"h.0\"")]
    EmptyModule {
        /// The parameter.
        name: String,
    },
    /// Two parameters share a name.
    #[error("duplicate parameter name `{name}` (entries #{first} and #{second}): names must be unique")]
    DuplicateName {
        /// The name.
        name: String,
        /// Position of its first occurrence.
        first: usize,
        /// Position of its second occurrence.
        second: usize,
    },
    /// A dimension of size zero.
    #[error(
        "parameter `{name}` has shape {shape:?} with a zero in dimension {dim}: sizes must be at least 1"
    )]
    ZeroDim {
        /// The parameter.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The first zero dimension.
        dim: usize,
    },
    /// The element count or byte size does not fit the address space.
    #[error("parameter `{name}` with shape {shape:?} of {dtype} is too large to address")]
    TooLarge {
        /// The parameter.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
    },
    /// More parameters than a [`ParamId`] can number.
    #[error("{count} parameters: at most {max} are supported", max = u32::MAX)]
    TooMany {
        /// How many were given.
        count: usize,
    },
    /// A trainability mask whose length is not the number of parameters.
    #[error("trainability mask has {got} entries but there are {expected} parameters")]
    MaskLength {
        /// Entries in the mask.
        got: usize,
        /// Parameters in the set.
        expected: usize,
    },
}

/// Why a parameter file (JSON) was rejected by [`ParamSet::from_json`](crate::ParamSet::from_json).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParamFileError {
    /// Not valid JSON, or not the expected shape.
    #[error("parameter file, line {line} column {column}: {message} (expected {{\"params\": [{{\"name\", \"shape\", \"dtype\", \"trainable\", \"module\"}}, ...]}})")]
    Json {
        /// 1-based line of the problem.
        line: usize,
        /// 1-based column of the problem.
        column: usize,
        /// What is wrong there.
        message: String,
    },
    /// A dtype name that is not one of [`DType`]'s.
    #[error("parameter `{name}` (entry #{index}): unknown dtype `{dtype}` (expected one of f32, f16, bf16, f64, u8, i8)")]
    UnknownDType {
        /// The parameter.
        name: String,
        /// Position in the list.
        index: usize,
        /// The dtype as given.
        dtype: String,
    },
    /// The list parsed but is not a valid parameter set.
    #[error(transparent)]
    Param(#[from] ParamError),
}
