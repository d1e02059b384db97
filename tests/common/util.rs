//! Small checks on a running gateway process.

use super::Gw;

pub fn assert_no_panic(gw: &Gw) {
    let log = gw.log();
    assert!(!log.contains("panicked"), "a panic in the log:\n{log}");
}

/// Open file descriptors of a process.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}
