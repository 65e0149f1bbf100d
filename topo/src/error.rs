//! The one error type of `collsched-topo`.

use std::path::PathBuf;

/// Everything that can go wrong while getting, checking or pricing a topology.
///
/// Each variant carries the offending values and says what to try.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopoError {
    /// A file could not be read or written.
    #[error("topology file {path}: {source}; check the path and its permissions")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file is not text (not UTF-8): not an XML export.
    #[error("topology file {path} is not text (not UTF-8); give an hwloc XML export (`lstopo machine.xml`) or the project's JSON")]
    NotText {
        /// The file.
        path: std::path::PathBuf,
    },
    /// The text is not well-formed XML.
    #[error("hwloc XML {origin}: not well-formed XML: {message}")]
    Xml {
        /// Where the text came from (a path or `<string>`).
        origin: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// The XML is well formed but is not an hwloc topology, or one of its objects is malformed.
    #[error("hwloc XML {origin}: {message}")]
    HwlocXml {
        /// Where the text came from (a path or `<string>`).
        origin: String,
        /// What is wrong and where (element position or object id).
        message: String,
    },
    /// The project's own JSON could not be read.
    #[error("topology JSON {origin}: {message}")]
    Json {
        /// Where the text came from (a path or `<string>`).
        origin: String,
        /// serde_json's message, with line and column.
        message: String,
    },
    /// A field of a topology has a value the library cannot use.
    #[error("topology `{topology}`: field `{field}` {message}")]
    Invalid {
        /// The topology's name.
        topology: String,
        /// The field, as a path (`intra_node.bandwidth_gbs`).
        field: String,
        /// What is wrong with it and what would be accepted.
        message: String,
    },
    /// An hwloc synthetic description could not be parsed.
    #[error("synthetic description `{description}`: level `{level}`: {message}")]
    Synthetic {
        /// The whole description.
        description: String,
        /// The offending level (token).
        level: String,
        /// What is wrong and what is accepted.
        message: String,
    },
    /// `--preset NAME` named no built-in machine.
    #[error("unknown preset machine `{name}`; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The built-in names, comma separated.
        known: String,
    },
    /// A rank group request does not fit the world.
    #[error("rank groups: {message}")]
    Groups {
        /// What does not fit, with the numbers.
        message: String,
    },
    /// hwloc discovery of the live machine failed (feature `hwloc`).
    #[error("hwloc discovery: {api} failed: {message}")]
    Discovery {
        /// The hwloc/hwlocality call that failed.
        api: &'static str,
        /// Its message.
        message: String,
    },
}
