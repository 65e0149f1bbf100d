//! Sizes as people write them on command lines and in environment variables, and the
//! machine's memory they are checked against.

/// Parses `4096`, `4K`, `16M`, `1G` (powers of 1024; a trailing `B` or `iB` is accepted).
///
/// # Errors
/// A message naming the text if it is not such a size.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize =
        num.parse().map_err(|_| format!("size `{s}`: expected a number with an optional K, M or G"))?;
    n.checked_mul(1usize << shift).ok_or_else(|| format!("size `{s}` does not fit in memory addresses"))
}

/// Bytes of memory the kernel says are available (`MemAvailable` of `/proc/meminfo`), if it
/// says.
pub fn memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: usize = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert!(parse_size("lots").unwrap_err().contains("lots"));
    }
}
