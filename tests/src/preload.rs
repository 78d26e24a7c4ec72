//! A shared library that says who loaded it: the tests' way of seeing whether code a caller
//! or an image author chose (`LD_PRELOAD`, an image's `/etc/ld.so.preload`) ran in something
//! stasisd runs as root.

use std::path::{Path, PathBuf};
use std::process::Command;

/// One process that loaded the marker library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loader {
    /// Its effective user id.
    pub euid: u32,
    /// Whether CAP_SYS_ADMIN was in its capability bounding set: a container's processes
    /// lose it, what stasisd runs keeps it.
    pub sys_admin: bool,
    /// Its program, as /proc/self/exe named it where it ran.
    pub exe: String,
    /// Its parent's program, named the same way.
    pub parent: String,
    /// Its command line, the arguments joined by spaces.
    pub command: String,
}

/// The marker library's C source; `@MARKER@` is the marker file's path.
const SOURCE: &str = r#"
#include <stdio.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <linux/capability.h>

static void link_of(const char *link, char *out, size_t size) {
    ssize_t n = readlink(link, out, size - 1);
    out[n > 0 ? n : 0] = 0;
}

__attribute__((constructor)) static void mark(void) {
    char exe[512], parent[512], link[64], cmd[512] = {0};
    link_of("/proc/self/exe", exe, sizeof exe);
    snprintf(link, sizeof link, "/proc/%d/exe", (int)getppid());
    link_of(link, parent, sizeof parent);
    FILE *c = fopen("/proc/self/cmdline", "r");
    if (c) {
        size_t n = fread(cmd, 1, sizeof cmd - 1, c);
        for (size_t i = 0; i < n; i++)
            if (!cmd[i]) cmd[i] = ' ';
        fclose(c);
    }
    int admin = prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, 0, 0, 0) == 1;
    FILE *f = fopen("@MARKER@", "a");
    if (f) {
        fprintf(f, "euid=%d\tsysadmin=%d\texe=%s\tparent=%s\tcmd=%s\n", (int)geteuid(), admin, exe, parent, cmd);
        fclose(f);
    }
}
"#;

/// Builds `dir/mark.so`, whose constructor appends a line of tab-separated fields (`euid=`,
/// `sysadmin=`, `exe=`, `parent=`, `cmd=`) for whatever process loads it to `marker` (a path as
/// that process sees it).
pub fn marker_library(dir: &Path, marker: &Path) -> PathBuf {
    let source = dir.join("mark.c");
    let library = dir.join("mark.so");
    let code = SOURCE.replace("@MARKER@", &marker.display().to_string());
    std::fs::write(&source, code).expect("writing the marker library's source");
    let out = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&library).arg(&source).output();
    let out = out.expect("running cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    library
}

/// The processes that loaded the marker library, from its marker file `marker`.
pub fn loaders(marker: &Path) -> Vec<Loader> {
    let text = std::fs::read_to_string(marker).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split('\t');
            let mut field = |key: &str| fields.next()?.strip_prefix(key).map(str::to_owned);
            let euid = field("euid=")?.parse().ok()?;
            let sys_admin = field("sysadmin=")? == "1";
            let (exe, parent, command) = (field("exe=")?, field("parent=")?, field("cmd=")?);
            Some(Loader { euid, sys_admin, exe, parent, command: command.trim_end().to_owned() })
        })
        .collect()
}

/// The lines of marker file `marker` written by a process with CAP_SYS_ADMIN in its bounding
/// set, read as text (so that a line [`loaders`] cannot parse is not missed).
pub fn privileged_lines(marker: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(marker).unwrap_or_default();
    text.lines().filter(|l| l.contains("sysadmin=1")).map(str::to_owned).collect()
}
