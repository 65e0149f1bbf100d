//! hwloc synthetic descriptions (`pack:2 numa:1 core:8 pu:2`), parsed without the hwloc library.
//!
//! Supported: a whitespace-separated list of `type:count` levels, top-down, each count a
//! positive integer, the last level `pu`. Types (case-insensitive) and their aliases:
//! `group`; `package` = `pack` = `socket`; `die`; `numa` = `numanode` = `node`;
//! caches `l1`..`l5` and `l1i`..`l3i`, with or without a `cache` suffix (`l3cache`); `core`;
//! `pu` = `thread`. Levels must come in hwloc's order (group, package, die, caches from L5 down
//! to L1, core, pu), with `numa` and `group` anywhere above `core`.
//!
//! Not supported (a clear error): attributes in parentheses (`numa:2(memory=1GB)`), index
//! lists, memory-side caches, and the `[...]` memory-children syntax of hwloc 2.
//!
//! The result has no GPUs and no NICs: its links are shared memory inside the node and one
//! typical Ethernet adapter between nodes. Without a `numa` level the machine has one NUMA node
//! (as hwloc adds one); without a `package` level it has none.

use crate::{LinkClass, Machine, NumaNode, TopoError, Topology};

/// The largest number of PUs a synthetic description may produce.
pub const MAX_SYNTHETIC_PUS: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Group,
    Package,
    Die,
    Numa,
    Cache(u8),
    ICache(u8),
    Core,
    Pu,
}

impl Level {
    fn parse(name: &str) -> Option<Level> {
        let n = name.to_ascii_lowercase();
        Some(match n.as_str() {
            "group" => Level::Group,
            "package" | "pack" | "socket" => Level::Package,
            "die" => Level::Die,
            "numa" | "numanode" | "node" => Level::Numa,
            "core" => Level::Core,
            "pu" | "thread" => Level::Pu,
            _ => {
                let c = n.strip_suffix("cache").unwrap_or(&n);
                let c = c.strip_prefix('l')?;
                let (digit, icache) = match c.strip_suffix('i') {
                    Some(d) => (d, true),
                    None => (c, false),
                };
                let d: u8 = digit.parse().ok()?;
                match (icache, d) {
                    (false, 1..=5) => Level::Cache(d),
                    (true, 1..=3) => Level::ICache(d),
                    _ => return None,
                }
            }
        })
    }

    /// hwloc's top-down order; `None` for levels that may sit anywhere above `core`.
    fn rank(self) -> Option<u8> {
        match self {
            Level::Group | Level::Numa => None,
            Level::Package => Some(1),
            Level::Die => Some(2),
            Level::Cache(d) | Level::ICache(d) => Some(10 - d),
            Level::Core => Some(20),
            Level::Pu => Some(21),
        }
    }
}

/// Builds a one-node [`Topology`] from an hwloc synthetic description.
///
/// # Errors
/// [`TopoError::Synthetic`] naming the level: an unknown type, a missing or non-positive count,
/// unsupported syntax, levels out of order or repeated, a last level other than `pu`, or more
/// than [`MAX_SYNTHETIC_PUS`] PUs.
///
/// # Examples
/// ```
/// let t = collsched_topo::from_synthetic("pack:2 numa:1 core:8 pu:2")?;
/// assert_eq!((t.machine.packages, t.machine.numa_nodes.len(), t.machine.cores, t.machine.pus), (2, 2, 16, 32));
/// # Ok::<(), collsched_topo::TopoError>(())
/// ```
pub fn from_synthetic(description: &str) -> Result<Topology, TopoError> {
    let err = |level: &str, message: String| TopoError::Synthetic {
        description: description.to_owned(),
        level: level.to_owned(),
        message,
    };
    let tokens: Vec<&str> = description.split_whitespace().collect();
    if tokens.is_empty() {
        return Err(err("", "is empty; give levels like `pack:2 core:8 pu:2`".to_owned()));
    }
    let mut levels: Vec<(Level, u64)> = Vec::new();
    for tok in &tokens {
        if tok.contains(['(', ')', '[', ']']) {
            return Err(err(tok, "attributes, index lists and [memory children] are not supported; use plain type:count levels".to_owned()));
        }
        let Some((name, count)) = tok.split_once(':') else {
            return Err(err(tok, "is not of the form type:count".to_owned()));
        };
        let level = Level::parse(name).ok_or_else(|| {
            err(
                tok,
                format!("unknown type `{name}`; use group, pack, die, numa, l1..l5, l1i..l3i, core or pu"),
            )
        })?;
        let count: u64 = count
            .parse()
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| err(tok, format!("count `{count}` is not a positive integer")))?;
        if let Some(r) = level.rank() {
            if let Some(prev) = levels.iter().filter_map(|(l, _)| l.rank()).max() {
                if r <= prev {
                    return Err(err(tok, "comes after a level it must be above, or repeats one (order: group, pack, die, l5..l1, core, pu)".to_owned()));
                }
            }
        } else if levels.iter().any(|(l, _)| *l == level && level == Level::Numa) {
            return Err(err(tok, "a second numa level is not supported".to_owned()));
        } else if levels.iter().any(|(l, _)| matches!(l, Level::Core | Level::Pu)) {
            return Err(err(tok, "must come above core".to_owned()));
        }
        levels.push((level, count));
    }
    let last = tokens.last().copied().unwrap_or("");
    if levels.last().map(|(l, _)| *l) != Some(Level::Pu) {
        return Err(err(last, "the last level must be pu".to_owned()));
    }

    // Cumulative counts down the tree.
    let mut total: u64 = 1;
    let mut packages = 0u64;
    let mut numa = 1u64;
    let mut numa_under_package: Option<u64> = None; // NUMA nodes per package, when numa is below pack
    let mut cores = 0u64;
    for (tok, (level, count)) in tokens.iter().zip(&levels) {
        total = total
            .checked_mul(*count)
            .filter(|&t| t <= MAX_SYNTHETIC_PUS)
            .ok_or_else(|| err(tok, format!("makes more than {MAX_SYNTHETIC_PUS} objects")))?;
        match level {
            Level::Package => packages = total,
            Level::Numa => {
                numa = total;
                numa_under_package = total.checked_div(packages);
            }
            Level::Core => cores = total,
            _ => {}
        }
    }
    let numa_nodes = (0..numa)
        .map(|i| NumaNode {
            os_index: i as u32,
            memory_bytes: 0,
            package: numa_under_package.map(|per| (i / per) as u32),
        })
        .collect();
    let machine = Machine {
        packages: packages as u32,
        cores: cores as u32,
        pus: total as u32,
        numa_nodes,
        gpus: Vec::new(),
        nics: Vec::new(),
        nvswitches: 0,
    };
    let t = Topology {
        name: "synthetic".to_owned(),
        source: format!("hwloc synthetic `{description}`"),
        nodes: 1,
        machine,
        intra_node: LinkClass::SharedMemory.typical_link(),
        inter_node: LinkClass::Ethernet.typical_link(),
    };
    t.validate()?;
    Ok(t)
}

impl Topology {
    /// One node's CPU and memory tree as an hwloc synthetic description (`pack:2 numa:1
    /// core:56 pu:2`), which [`from_synthetic`] and hwloc read back; `None` when the counts do
    /// not divide evenly level by level (hwloc's synthetic language describes only symmetric
    /// trees). GPUs, NICs and memory sizes are not part of the language.
    ///
    /// # Examples
    /// ```
    /// let t = collsched_topo::preset("cpu-2socket")?;
    /// assert_eq!(t.to_synthetic().as_deref(), Some("pack:2 numa:1 core:16 pu:2"));
    /// # Ok::<(), collsched_topo::TopoError>(())
    /// ```
    pub fn to_synthetic(&self) -> Option<String> {
        let m = &self.machine;
        let (p, n, c, u) = (m.packages, m.numa_nodes.len().max(1) as u32, m.cores, m.pus);
        let div = |a: u32, b: u32| (b > 0 && a.is_multiple_of(b)).then(|| a / b);
        let mut levels = Vec::new();
        // The NUMA and package levels, whichever is above the other, then the level below them.
        let above_cores = if p == 0 {
            levels.push(format!("numa:{n}"));
            n
        } else if let Some(per) = div(n, p) {
            levels.push(format!("pack:{p}"));
            levels.push(format!("numa:{per}"));
            n
        } else {
            levels.push(format!("numa:{n}"));
            levels.push(format!("pack:{}", div(p, n)?));
            p
        };
        let above_pus = if c > 0 {
            levels.push(format!("core:{}", div(c, above_cores)?));
            c
        } else {
            above_cores
        };
        levels.push(format!("pu:{}", div(u, above_pus)?));
        Some(levels.join(" "))
    }
}
