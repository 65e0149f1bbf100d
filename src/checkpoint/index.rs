//! [`Index`]: what a checkpoint holds and where (`index.json`, written last).

use serde::{Deserialize, Serialize};

/// The `format` of every index this crate writes.
pub const FORMAT: &str = "collsched-checkpoint-1";

/// The index of a checkpoint directory: written last, so a directory without it is an
/// incomplete save.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// [`FORMAT`].
    pub format: String,
    /// Ranks that saved it.
    pub world: u32,
    /// Their sharding strategy (`even`, `flat`, `greedy`, `hybrid:G`).
    pub strategy: String,
    /// Their plan's fingerprint.
    pub fingerprint: String,
    /// The training step the caller gave.
    pub step: u64,
    /// The data files, in the directory (`rank-R.safetensors`).
    pub files: Vec<String>,
    /// Every parameter, in the plan's order.
    pub params: Vec<IndexParam>,
    /// Per-parameter states saved beside the parameters (an optimizer's moments), each named
    /// `param#state`, with the parameter's shape and pieces; they may cover only some elements
    /// (ranks without the state saved none).
    #[serde(default)]
    pub extras: Vec<IndexParam>,
    /// What the caller gave to keep with the checkpoint (optimizer hyperparameters, counters).
    #[serde(default)]
    pub meta: serde_json::Value,
    /// The save that wrote it, also in every data file's metadata (`collsched.save`): a file
    /// of another save (the checkpoint replaced while it is read, files of two checkpoints
    /// mixed) is refused. Empty in checkpoints written before it was kept (not checked).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub save: String,
}

/// One parameter of an [`Index`] and the pieces that hold it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexParam {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype (`f32`, `bf16`, `f16`, ...).
    pub dtype: String,
    /// Pieces that together hold every element once, in element order.
    pub pieces: Vec<Piece>,
}

/// A run of a parameter's elements (flattened) in one data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Piece {
    /// Position of the file in [`Index::files`].
    pub file: u32,
    /// The tensor's name in that file (a 1-D tensor of `numel` elements).
    pub tensor: String,
    /// First element of the parameter it holds.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

/// The name of the tensor holding `param`'s elements from `offset` on.
pub fn tensor_name(param: &str, offset: usize) -> String {
    format!("{param}@{offset}")
}

impl Index {
    /// Checks that the pieces of every parameter cover its elements exactly once (those of an
    /// extra state at most once) and name files of the index; returns the first problem.
    pub fn check(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", self.format));
        }
        for p in &self.params {
            p.check_pieces(self.files.len(), true)?;
        }
        for p in &self.extras {
            p.check_pieces(self.files.len(), false)?;
        }
        Ok(())
    }
}

impl IndexParam {
    /// Elements of the parameter, if its shape does not overflow.
    pub fn numel(&self) -> Option<usize> {
        self.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }

    /// Pieces in element order, inside the parameter, in files of the index; with `whole`,
    /// covering every element.
    fn check_pieces(&self, files: usize, whole: bool) -> Result<(), String> {
        let name = &self.name;
        let numel =
            self.numel().ok_or_else(|| format!("parameter {name}: shape {:?} overflows", self.shape))?;
        let mut next = 0;
        for piece in &self.pieces {
            if piece.file as usize >= files {
                return Err(format!("parameter {name}: a piece names file {} of {files}", piece.file));
            }
            if piece.offset < next || (whole && piece.offset != next) {
                return Err(format!(
                    "parameter {name}: elements {next}..{} are in no piece (or in two)",
                    piece.offset
                ));
            }
            next = piece
                .offset
                .checked_add(piece.numel)
                .ok_or_else(|| format!("parameter {name}: piece overflows"))?;
        }
        if next > numel || (whole && next != numel) {
            return Err(format!("parameter {name}: its pieces hold {next} of its {numel} elements"));
        }
        Ok(())
    }
}
