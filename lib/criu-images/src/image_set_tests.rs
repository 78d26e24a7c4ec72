//! Tests of the image-set check with fake image sets.

use std::collections::{BTreeSet, HashMap};

use stasis_proto::criu::refs::{Core, MemfdInode};

use crate::image_set::{
    CORE_MAGIC, ImageSetError, MEMFD_INODE_MAGIC, MissingImage, check, check_dir, image_names, read_by_check,
};
use crate::images::PSTREE_MAGIC;
use crate::testing::{ANON_SHARED, core, image, mm, process, write_dump_images};

const SYSV_SHARED: u32 = ANON_SHARED | (1 << 10);

/// A whole set: process 1 (threads 1 and 3) with a shared anonymous mapping (shmid 77), a SysV
/// one (99, whose content is elsewhere) and two memfds (55 with content, 56 empty); process 2
/// a zombie. As (names, contents).
fn whole_set() -> (BTreeSet<String>, HashMap<String, Vec<u8>>) {
    let mut contents = HashMap::new();
    // CRIU writes a zombie's thread id unset: whatever its memory held.
    let zombie = process(2, &[1_444_030_176]);
    contents.insert("pstree.img".into(), image(PSTREE_MAGIC, &[process(1, &[1, 3]), zombie]));
    contents.insert("core-1.img".into(), core(1));
    contents.insert("core-3.img".into(), core(1));
    contents.insert("core-2.img".into(), core(2));
    contents.insert("mm-1.img".into(), mm(&[(0x7000_0000, 77, ANON_SHARED), (0x7100_0000, 99, SYSV_SHARED)]));
    let memfds = [MemfdInode { size: 4096, shmid: 55 }, MemfdInode { size: 0, shmid: 56 }];
    contents.insert("memfd.img".into(), image(MEMFD_INODE_MAGIC, &memfds));
    let files: Vec<&str> =
        contents.keys().map(String::as_str).chain(["inventory.img", "files.img"]).collect();
    let memory = [(1 << 8) | 1, (77 << 8) | 2, (55 << 8) | 2];
    (image_names(files, memory), contents)
}

fn missing(names: &BTreeSet<String>, contents: &HashMap<String, Vec<u8>>) -> Vec<MissingImage> {
    match check(names, contents) {
        Err(ImageSetError::Incomplete { missing }) => missing,
        other => panic!("expected missing images, got {other:?}"),
    }
}

fn without(names: &BTreeSet<String>, gone: &[&str]) -> BTreeSet<String> {
    names.iter().filter(|n| !gone.contains(&n.as_str())).cloned().collect()
}

#[test]
fn a_whole_set_passes() {
    let (names, contents) = whole_set();
    assert!(names.contains("pagemap-1.img") && names.contains("pagemap-shmem-77.img"), "{names:?}");
    check(&names, &contents).unwrap();
}

#[test]
fn a_never_written_shared_mapping_without_its_pagemap_is_named() {
    // What stasis stored before issue 24 (item 1): the memfd's and the mapping's pagemaps had
    // no runs, so no memory image.
    let (names, contents) = whole_set();
    let found = missing(&without(&names, &["pagemap-shmem-77.img", "pagemap-shmem-55.img"]), &contents);
    let images: Vec<&str> = found.iter().map(|m| m.image.as_str()).collect();
    assert_eq!(images, ["pagemap-shmem-77.img", "pagemap-shmem-55.img"]);
    assert_eq!(found[0].needed_for, "the shared memory at 0x70000000-0x70001000 of process 1 in mm-1.img");
    assert_eq!(found[1].needed_for, "the 4096 bytes of memfd 55 in memfd.img");
    let error = ImageSetError::Incomplete { missing: found }.to_string();
    assert!(
        error.starts_with("images are missing: pagemap-shmem-77.img (for the shared memory at"),
        "{error}"
    );
}

#[test]
fn each_reference_of_the_tree_is_followed() {
    let (names, contents) = whole_set();
    let found = missing(&without(&names, &["core-3.img", "pagemap-1.img", "inventory.img"]), &contents);
    let found: Vec<(&str, &str)> = found.iter().map(|m| (m.image.as_str(), m.needed_for.as_str())).collect();
    assert_eq!(
        found,
        [
            ("inventory.img", "every restore"),
            ("core-3.img", "thread 3 of process 1 in pstree.img"),
            ("pagemap-1.img", "the memory of process 1"),
        ]
    );
    // A zombie needs no address space, nor the core image of the thread pstree.img gives it;
    // the same process alive does, and its own core image always.
    let mut alive = contents.clone();
    alive.insert("core-2.img".into(), core(1));
    let found: Vec<String> = missing(&names, &alive).into_iter().map(|m| m.image).collect();
    assert_eq!(found, ["core-1444030176.img", "mm-2.img", "pagemap-2.img"]);
    let mut unknown = contents.clone();
    unknown.remove("core-2.img");
    let found: Vec<String> =
        missing(&without(&names, &["core-2.img"]), &unknown).into_iter().map(|m| m.image).collect();
    assert_eq!(
        found,
        ["core-1444030176.img", "mm-2.img", "pagemap-2.img"],
        "without its core, not known a zombie"
    );
    // Without the address space's image, its shared mappings are not known, the image is.
    let found: Vec<String> =
        missing(&without(&names, &["mm-1.img"]), &contents).into_iter().map(|m| m.image).collect();
    assert_eq!(found, ["mm-1.img"]);
    // No tree at all.
    let found: Vec<String> =
        missing(&BTreeSet::new(), &HashMap::new()).into_iter().map(|m| m.image).collect();
    assert_eq!(found, ["inventory.img", "pstree.img"]);
}

#[test]
fn a_malformed_image_is_named() {
    let (names, mut contents) = whole_set();
    contents.insert("mm-1.img".into(), b"not an image".to_vec());
    let error = check(&names, &contents).unwrap_err();
    assert!(matches!(&error, ImageSetError::Malformed { image, .. } if image == "mm-1.img"), "{error:?}");
    contents.insert("mm-1.img".into(), image(CORE_MAGIC, &[Core::default()]));
    assert!(matches!(check(&names, &contents), Err(ImageSetError::Malformed { .. })), "wrong magic");
}

#[test]
fn images_in_a_directory_are_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    write_dump_images(dir.path(), 42, &[]);
    let files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let names = image_names(files.iter().map(String::as_str), [(42 << 8) | 1]);
    check_dir(dir.path(), &names).unwrap();
    let error = check_dir(dir.path(), &image_names(files.iter().map(String::as_str), [])).unwrap_err();
    assert_eq!(error.to_string(), "images are missing: pagemap-42.img (for the memory of process 42)");
    // A name the check reads that is not in the directory.
    let mut names = names;
    names.insert("core-7.img".into());
    assert!(matches!(check_dir(dir.path(), &names), Err(ImageSetError::Unreadable { .. })));
}

#[test]
fn only_the_images_that_refer_to_others_are_read() {
    for name in ["pstree.img", "memfd.img", "core-1.img", "core-12345.img", "mm-7.img"] {
        assert!(read_by_check(name), "{name}");
    }
    for name in ["pages-1.img", "pagemap-1.img", "core-.img", "core-1a.img", "mm-1.img.tmp", "files.img"] {
        assert!(!read_by_check(name), "{name}");
    }
}
