//! Container checkpoint archives in and out (`stasis export`, `stasis import`), against the
//! real tools: `checkpointctl` reads stasis' export, and CRIU restores the unpacked archive
//! by itself; an export imported again costs the store nothing new (the same chunks) and
//! restores; an archive Podman wrote is imported, keeps Podman's files, is given back by an
//! export that Podman reads, and is restored (through Podman) to go on where it was; archives
//! that are not checkpoints, or reach outside themselves, are refused with the reason.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use stasis_tests::podman::Podman;
use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, Workload, criu_path, expect_within, procfs, python, python_workload,
    skip_unless_ready,
};

/// The checkpointctl of scripts/setup-checkpointctl.sh.
fn checkpointctl(args: &[&str], archive: &Path) -> String {
    let tool = std::env::var_os("STASIS_CHECKPOINTCTL").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/checkpointctl/bin/checkpointctl")
    });
    let out = Command::new(&tool)
        .args(args)
        .arg(archive)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", tool.display()));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "checkpointctl {args:?}: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    text
}

/// A counter, evicted; returns it and its checkpoint's id.
fn evicted_counter(d: &Daemon) -> (Workload, String) {
    let w = d.run("counter", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    procfs::wait_gone(w.pid, "the evicted counter to be gone");
    (w, ck["id"].as_str().unwrap().to_owned())
}

#[test]
fn an_export_is_read_by_checkpointctl_and_restored_by_criu_from_the_unpacked_archive() {
    skip_unless_ready!();
    let d = Daemon::start();
    let (w, id) = evicted_counter(&d);
    let at_checkpoint = w.last_number("count ").unwrap();
    let archive = d.dir().join("counter.tar.zst");
    let out = d.json(&["export", &id, "-o", &archive.display().to_string(), "--json"]);
    assert!(out["files"].as_array().unwrap().iter().any(|f| f == "checkpoint/pstree.img"), "{out}");
    let err = d.cli_err(&["export", &id, "-o", &archive.display().to_string()]);
    assert!(err.contains("it exists already"), "{err}");

    let shown = checkpointctl(&["show"], &archive);
    assert!(shown.contains(&w.name) && shown.contains("stasis"), "{shown}");
    let tree = checkpointctl(&["inspect", "--ps-tree", "--stats"], &archive);
    assert!(tree.contains("stasis-init") && tree.contains("python3"), "the process tree: {tree}");
    assert!(tree.contains("Pages written"), "CRIU's statistics: {tree}");

    // CRIU alone restores the unpacked images, with the options stasis recorded.
    let unpacked = d.dir().join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    let status = Command::new("tar").arg("-C").arg(&unpacked).arg("--zstd").arg("-xf").arg(&archive).status();
    assert!(status.is_ok_and(|s| s.success()), "unpacking {}", archive.display());
    let options = d.json(&["show", &id, "--json"])["criu_options"].clone();
    let flags: Vec<String> =
        options.as_array().unwrap().iter().filter_map(|o| o.as_str()).map(|o| format!("--{o}")).collect();
    let skip = w.lines().len();
    let images = unpacked.join("checkpoint");
    let restored = Command::new(criu_path())
        .args(["restore", "-d", "-o", "restore.log", "-D"])
        .arg(&images)
        .args(&flags)
        .status()
        .expect("criu");
    let log = std::fs::read_to_string(images.join("restore.log")).unwrap_or_default();
    assert!(restored.success(), "criu restore -D: {}", &log[log.len().saturating_sub(2000)..]);
    let (_, line) = w.wait_line_after(skip, "a count after CRIU's restore", |l| l.starts_with("count "));
    let first: u64 = line["count ".len()..].split_whitespace().next().unwrap().parse().unwrap();
    assert!((at_checkpoint..=at_checkpoint + 1).contains(&first), "it goes on from {at_checkpoint}: {line}");
    procfs::in_workload_cgroup(&w.name).into_iter().for_each(procfs::kill9);
}

#[test]
fn an_export_imported_again_stores_nothing_new_and_restores() {
    skip_unless_ready!();
    let d = Daemon::start();
    let (w, id) = evicted_counter(&d);
    let at_checkpoint = w.last_number("count ").unwrap();
    let archive = d.dir().join("counter.tar");
    d.json(&["export", &id, "-o", &archive.display().to_string(), "--compress", "none", "--json"]);
    let copy = format!("{}-again", w.name);
    let imported = d.json(&["import", &archive.display().to_string(), "--workload", &copy, "--json"]);
    assert_eq!(imported["engine"], "stasis", "{imported}");
    assert_eq!(imported["bytes_uploaded"], 0, "the same chunks: nothing new for the store: {imported}");
    let shown =
        (d.json(&["show", &id, "--json"]), d.json(&["show", imported["id"].as_str().unwrap(), "--json"]));
    assert_eq!(shown.0["files"], shown.1["files"], "the same images");
    assert_eq!(shown.0["bytes_total"], shown.1["bytes_total"]);

    d.json(&["restore", imported["id"].as_str().unwrap(), "--json"]);
    let again = d.known(&copy, &w.argv);
    again.wait_number("count ", 0);
    let first = again.numbers("count ")[0];
    assert!((at_checkpoint..=at_checkpoint + 1).contains(&first), "from {at_checkpoint}: {first}");
    let status = d.workload(&copy);
    assert_eq!(status["state"], "running", "{status}");
}

#[test]
fn a_podman_archive_is_imported_given_back_and_restored_through_podman() {
    skip_unless_ready!();
    let Some(podman) = Podman::start() else { return };
    let d = Daemon::start_with(&DaemonOptions { env: podman.env.clone(), ..Default::default() });
    let name = d.workload_name("ctr");
    podman.run_container(&name, "i=0; while true; do echo $i; i=$((i+1)); sleep 0.1; done");
    expect_within(TIMEOUT, "the container to count", || (podman.logs(&name).len() >= 5).then_some(()));
    let written = podman.path("podman.tar.zst");
    podman.ok(&[
        "container",
        "checkpoint",
        "--export",
        &written.display().to_string(),
        "--compress",
        "zstd",
        &name,
    ]);
    let at_checkpoint: u64 = podman.logs(&name).last().unwrap().parse().unwrap();

    let imported = d.json(&["import", &written.display().to_string(), "--json"]);
    assert_eq!(
        (imported["engine"].as_str(), imported["workload"].as_str()),
        (Some("podman"), Some(format!("imported.{name}").as_str()))
    );
    let kept: Vec<&str> = imported["kept"].as_array().unwrap().iter().filter_map(|k| k.as_str()).collect();
    for file in ["config.dump", "spec.dump", "rootfs-diff.tar", "checkpoint/pstree.img"] {
        assert!(kept.contains(&file), "{file} kept: {kept:?}");
    }
    let id = imported["id"].as_str().unwrap();
    let shown = d.ok(&["show", id]);
    assert!(shown.contains(&format!("imported from: podman archive (container {name}")), "{shown}");

    // Given back: an archive checkpointctl reads as Podman's.
    let back = podman.path("back.tar.zst");
    d.json(&["export", id, "-o", &back.display().to_string(), "--json"]);
    let shown = checkpointctl(&["show"], &back);
    assert!(shown.contains("Podman") && shown.contains(&name), "{shown}");

    // Restored: Podman recreates the container from what stasis writes back, and it goes on.
    podman.ok(&["rm", "-f", &name]);
    let restored = d.json(&["restore", id, "--json"]);
    assert!(restored["warnings"].to_string().contains("restored by podman"), "{restored}");
    assert!(procfs::alive(stasis_tests::pid_of(&restored)), "{restored}");
    let numbers = || -> Vec<u64> { podman.logs(&name).iter().filter_map(|l| l.parse().ok()).collect() };
    expect_within(TIMEOUT, "the restored container to count on", || {
        numbers().iter().any(|&n| n > at_checkpoint + 3).then_some(())
    });
    let after: Vec<u64> = numbers().into_iter().skip_while(|&n| n <= at_checkpoint).collect();
    assert_eq!(after.first(), Some(&(at_checkpoint + 1)), "it goes on from {at_checkpoint}: {after:?}");
}

#[test]
fn archives_that_are_not_checkpoints_or_reach_outside_are_refused() {
    skip_unless_ready!();
    let d = Daemon::start();
    let dir = d.dir().join("bad");
    std::fs::create_dir_all(dir.join("content")).unwrap();
    std::fs::write(dir.join("content/config.dump"), "{}").unwrap();
    let tar = |name: &str, args: &[&str]| {
        let path = dir.join(name);
        let status = Command::new("tar").arg("-cf").arg(&path).args(args).status();
        assert!(status.is_ok_and(|s| s.success()), "making {name}");
        path
    };
    let no_images = tar("no-images.tar", &["-C", dir.join("content").to_str().unwrap(), "config.dump"]);
    let outside =
        tar("outside.tar", &["-P", "-C", dir.join("content").to_str().unwrap(), "../content/config.dump"]);
    let not_tar = dir.join("not.tar");
    std::fs::write(&not_tar, vec![7u8; 4096]).unwrap();
    // An entry that says it is 64 TiB: refused from its header, before anything is written.
    let huge = dir.join("huge.tar");
    let header = "import sys, tarfile\nti = tarfile.TarInfo('checkpoint/pages-1.img')\nti.size = 1 << 46\n\
                  open(sys.argv[1], 'wb').write(ti.tobuf(format=tarfile.GNU_FORMAT) + bytes(4096))";
    let status = Command::new(python()).args(["-c", header]).arg(&huge).status();
    assert!(status.is_ok_and(|s| s.success()), "making huge.tar");
    for (archive, says) in [
        (&no_images, "no checkpoint/ directory"),
        (&outside, "an unsafe path"),
        (&not_tar, "not one stasis can take in"),
        (&huge, "unpacks to more than"),
    ] {
        let err = d.cli_err(&["import", &archive.display().to_string()]);
        assert!(err.contains(says), "{}: {err}", archive.display());
    }
    let listed = d.json(&["list", "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "nothing half-imported: {listed}");
}

/// The stasis manifest inside an uncompressed archive, unpacked into `dir`.
fn archived_manifest(archive: &Path, dir: &Path) -> stasis_proto::stasis::store::v1::Manifest {
    use stasis_proto::prost::Message as _;
    std::fs::create_dir_all(dir).unwrap();
    let status = Command::new("tar").arg("-C").arg(dir).arg("-xf").arg(archive).status();
    assert!(status.is_ok_and(|s| s.success()), "unpacking {}", archive.display());
    let bytes = std::fs::read(dir.join("stasis-manifest.pb")).expect("the archive's stasis manifest");
    stasis_proto::stasis::store::v1::Manifest::decode(bytes.as_slice()).expect("a manifest")
}

#[test]
fn an_import_is_roots_and_has_a_name_of_its_own_whatever_the_archive_says() {
    skip_unless_ready!();
    let d = Daemon::start();
    let (w, id) = evicted_counter(&d);
    let archive = d.dir().join("counter.tar");
    d.json(&["export", &id, "-o", &archive.display().to_string(), "--compress", "none", "--json"]);
    // The archive, edited to say that uid 1001 owns it.
    let edit = d.dir().join("edit");
    let mut manifest = archived_manifest(&archive, &edit);
    manifest.owner_uid = 1001;
    std::fs::write(edit.join("stasis-manifest.pb"), stasis_proto::prost::Message::encode_to_vec(&manifest))
        .unwrap();
    // Packed as people pack a directory, with its `./` entry.
    let edited = d.dir().join("edited.tar");
    let status = Command::new("tar").arg("-C").arg(&edit).arg("-cf").arg(&edited).arg(".").status();
    assert!(status.is_ok_and(|s| s.success()), "packing the edited archive");

    let imported = d.json(&["import", &edited.display().to_string(), "--json"]);
    assert_eq!(
        imported["workload"].as_str(),
        Some(format!("imported.{}", w.name).as_str()),
        "not the live workload's own name: {imported}"
    );
    let again = d.dir().join("again.tar");
    let imported_id = imported["id"].as_str().unwrap();
    d.json(&["export", imported_id, "-o", &again.display().to_string(), "--compress", "none", "--json"]);
    assert_eq!(archived_manifest(&again, &d.dir().join("again")).owner_uid, 0, "the import is root's");
}
