use super::*;
use std::os::unix::fs::PermissionsExt;

/// The stack of the threads that walk 100,000 levels: recursion would overflow it within a
/// few hundred levels.
const SMALL_STACK: usize = 64 << 10;

#[test]
fn create_dir_all_sets_exact_mode_and_reports_creation() {
    let t = tempfile::tempdir().unwrap();
    let root = Dir::open(t.path()).unwrap();
    let (d, created) = root.create_dir_all(Path::new("a/b/c"), 0o777).unwrap();
    assert!(created);
    assert_eq!(d.path(), t.path().join("a/b/c"));
    let mode = std::fs::metadata(t.path().join("a/b/c"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o777, "umask must not reduce the mode");
    let parent = std::fs::metadata(t.path().join("a/b"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(parent & 0o7777, 0o750, "parents are private");
    let (_, created) = root.create_dir_all(Path::new("a/b/c"), 0o777).unwrap();
    assert!(!created);
}

#[test]
fn make_child_takes_one_name_and_never_follows_a_link() {
    let t = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("link")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    let (d, created) = root.make_child(OsStr::new("v"), 0o777).unwrap();
    assert!(created);
    let mode = std::fs::metadata(d.path()).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o777, "exact, whatever the umask");
    assert!(
        !root.make_child(OsStr::new("v"), 0o777).unwrap().1,
        "opened"
    );
    for bad in ["a/b", "..", ".", "", "/abs"] {
        assert!(
            matches!(
                root.make_child(OsStr::new(bad), 0o777),
                Err(MountError::NotRelative { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(!t.path().join("a").exists());
    assert!(matches!(
        root.make_child(OsStr::new("link"), 0o777),
        Err(MountError::Symlink { .. })
    ));
}

#[test]
fn make_dir_makes_one_name_and_never_follows_a_link() {
    let t = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("link")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    assert!(root.make_dir(OsStr::new("v"), 0o700).unwrap(), "made");
    assert!(t.path().join("v").is_dir());
    assert!(
        !root.make_dir(OsStr::new("v"), 0o700).unwrap(),
        "there already"
    );
    // A link is something there already: nothing is made where it points.
    assert!(!root.make_dir(OsStr::new("link"), 0o700).unwrap());
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    for bad in ["a/b", "..", ".", "", "/abs"] {
        assert!(
            matches!(
                root.make_dir(OsStr::new(bad), 0o700),
                Err(MountError::NotRelative { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn walk_refuses_symlinks_and_backsteps() {
    let t = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("link")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    type Check = fn(&MountError) -> bool;
    let cases: [(&str, Check); 3] = [
        ("link/x", |e| matches!(e, MountError::Symlink { .. })),
        ("../x", |e| matches!(e, MountError::NotRelative { .. })),
        ("/etc", |e| matches!(e, MountError::NotRelative { .. })),
    ];
    for (rel, want) in cases {
        let err = root.create_dir_all(Path::new(rel), 0o755).unwrap_err();
        assert!(want(&err), "row {rel}: {err}");
    }
    assert_eq!(
        std::fs::read_dir(outside.path()).unwrap().count(),
        0,
        "nothing created outside"
    );
}

#[test]
fn fast_path_and_walk_agree_on_refusals() {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.path().join("a/b")).unwrap();
    std::os::unix::fs::symlink("/", t.path().join("a/root")).unwrap();
    std::os::unix::fs::symlink("b", t.path().join("a/rel")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    for rel in ["a/root", "a/root/etc", "a/rel"] {
        let fast = root.open_beneath(Path::new(rel)).unwrap_err();
        let walk = root.walk(&components(Path::new(rel)).unwrap()).unwrap_err();
        assert!(
            matches!(fast, MountError::Symlink { .. }),
            "row {rel}: {fast}"
        );
        assert!(
            matches!(walk, MountError::Symlink { .. }),
            "row {rel}: {walk}"
        );
    }
    assert_eq!(
        root.open_beneath(Path::new("a/b")).unwrap().path(),
        t.path().join("a/b")
    );
    assert!(root
        .open_beneath(Path::new("a/missing"))
        .unwrap_err()
        .is_not_found());
}

#[test]
fn remove_contents_does_not_follow_links() {
    let t = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("canary"), b"keep").unwrap();
    std::fs::create_dir_all(t.path().join("v/sub")).unwrap();
    std::fs::write(t.path().join("v/sub/file"), b"x").unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("v/escape")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("canary"), t.path().join("v/sub/f2")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    root.remove_dir_all_one_fs("v").unwrap();
    assert!(!t.path().join("v").exists());
    assert_eq!(
        std::fs::read(outside.path().join("canary")).unwrap(),
        b"keep"
    );
}

#[test]
fn remove_dir_all_one_fs_takes_an_empty_directory_at_once_and_never_a_link() {
    let t = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir(t.path().join("empty")).unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("link")).unwrap();
    let root = Dir::open(t.path()).unwrap();
    assert!(root.remove_dir_all_one_fs_found("empty").unwrap());
    assert!(!t.path().join("empty").exists());
    assert!(
        !root.remove_dir_all_one_fs_found("empty").unwrap(),
        "nothing there"
    );
    root.remove_dir_all_one_fs("empty").unwrap();
    std::fs::create_dir_all(t.path().join("full/sub")).unwrap();
    std::fs::write(t.path().join("full/sub/f"), "x").unwrap();
    assert!(root.remove_dir_all_one_fs_found("full").unwrap());
    assert!(!t.path().join("full").exists());
    assert!(root.remove_dir_all_one_fs("link").is_err());
    assert!(outside.path().exists() && t.path().join("link").symlink_metadata().is_ok());
    assert!(matches!(
        root.remove_dir_all_one_fs("link/x"),
        Err(MountError::NotRelative { .. })
    ));
}

#[test]
fn remove_empty_tree_never_unlinks_files() {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.path().join("pod/volumes/a")).unwrap();
    std::fs::create_dir_all(t.path().join("pod/volumes/b")).unwrap();
    std::fs::write(t.path().join("pod/volumes/b/data"), b"x").unwrap();
    let root = Dir::open(t.path()).unwrap();
    let err = root.remove_empty_tree("pod").unwrap_err();
    assert!(matches!(err, MountError::Leftover { .. }), "{err}");
    assert!(t.path().join("pod/volumes/b/data").exists());
    std::fs::remove_file(t.path().join("pod/volumes/b/data")).unwrap();
    root.remove_empty_tree("pod").unwrap();
    assert!(!t.path().join("pod").exists());
    root.remove_empty_tree("pod").unwrap();
    // A file or a link in its place is a leftover, kept.
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("link")).unwrap();
    std::fs::write(t.path().join("file"), b"x").unwrap();
    for name in ["link", "file"] {
        let err = root.remove_empty_tree(name).unwrap_err();
        assert!(matches!(err, MountError::Leftover { .. }), "{name}: {err}");
        assert!(
            t.path().join(name).symlink_metadata().is_ok(),
            "{name} kept"
        );
    }
    assert!(outside.path().exists());
}

#[test]
fn make_dirs_makes_a_chain_with_exact_modes_and_never_follows_a_link() {
    let t = tempfile::tempdir().unwrap();
    let root = Dir::open(t.path()).unwrap();
    let chain = |names: &[&'static str]| -> Vec<&'static OsStr> {
        names.iter().map(|n| OsStr::new(*n)).collect()
    };
    assert!(root
        .make_dirs(&chain(&["pod", "volumes", "p"]), 0o750)
        .unwrap());
    for d in ["pod", "pod/volumes", "pod/volumes/p"] {
        let mode = std::fs::metadata(t.path().join(d))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o750, "{d}");
    }
    // Made again: nothing new; a sibling below existing parents is made.
    assert!(!root
        .make_dirs(&chain(&["pod", "volumes", "p"]), 0o750)
        .unwrap());
    assert!(root
        .make_dirs(&chain(&["pod", "volumes", "q"]), 0o777)
        .unwrap());
    let mode = std::fs::metadata(t.path().join("pod/volumes/q"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o777, "exact, whatever the umask");
    // A link anywhere in the chain is refused, and nothing is made through it.
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("pod/link")).unwrap();
    for names in [&["pod", "link", "x"][..], &["pod", "link"][..]] {
        let r = root.make_dirs(&chain(names), 0o750);
        assert!(
            matches!(r, Err(MountError::Symlink { .. }) | Ok(false)),
            "{names:?}: {r:?}"
        );
    }
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
    for bad in [&["pod", ".."][..], &["a/b"][..]] {
        assert!(
            matches!(
                root.make_dirs(&chain(bad), 0o750),
                Err(MountError::NotRelative { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn remove_empty_tree_along_takes_the_chain_and_walks_what_else_is_there() {
    let t = tempfile::tempdir().unwrap();
    let root = Dir::open(t.path()).unwrap();
    // Just the chain.
    std::fs::create_dir_all(t.path().join("pod/volumes/p")).unwrap();
    root.remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap();
    assert!(!t.path().join("pod").exists());
    // Gone already, or the chain only in part: nothing to say.
    root.remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap();
    std::fs::create_dir_all(t.path().join("pod/volumes")).unwrap();
    root.remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap();
    assert!(!t.path().join("pod").exists());
    // Empty directories beside the chain go too; a file anywhere is kept and reported, and
    // so is the way to it.
    std::fs::create_dir_all(t.path().join("pod/volumes/p")).unwrap();
    std::fs::create_dir_all(t.path().join("pod/volumes/q/r")).unwrap();
    std::fs::create_dir_all(t.path().join("pod/volume-subpaths/v")).unwrap();
    std::fs::write(t.path().join("pod/volumes/q/r/data"), b"x").unwrap();
    let err = root
        .remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap_err();
    assert!(matches!(err, MountError::Leftover { .. }), "{err}");
    assert!(t.path().join("pod/volumes/q/r/data").exists());
    assert!(!t.path().join("pod/volumes/p").exists());
    assert!(!t.path().join("pod/volume-subpaths").exists());
    std::fs::remove_file(t.path().join("pod/volumes/q/r/data")).unwrap();
    root.remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap();
    assert!(!t.path().join("pod").exists());
    // A link where the chain goes is not followed: it is a leftover, and what it points
    // at is untouched.
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(outside.path().join("p")).unwrap();
    std::fs::create_dir_all(t.path().join("pod")).unwrap();
    std::os::unix::fs::symlink(outside.path(), t.path().join("pod/volumes")).unwrap();
    let err = root
        .remove_empty_tree_along("pod", &["volumes", "p"])
        .unwrap_err();
    assert!(matches!(err, MountError::Leftover { .. }), "{err}");
    assert!(outside.path().join("p").exists());
    assert!(t.path().join("pod/volumes").symlink_metadata().is_ok());
}

/// A pod that makes a tree 100,000 levels deep in its volume: the fsGroup walk, the check
/// and the removal each get through it on a thread with a small stack.
#[test]
fn a_tree_100000_levels_deep_gets_its_fs_group_and_is_removed_without_recursion() {
    let _one_at_a_time = crate::walk::tests::deep_trees();
    let t = crate::walk::tests::memory_tempdir();
    let v = t.path().join("v");
    std::fs::create_dir(&v).unwrap();
    let deepest = crate::walk::tests::chain(&v, 100_000);
    let gid = rustix::process::getgid().as_raw();
    let top = t.path().to_path_buf();
    std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(move || {
            let vol = Dir::open(&top.join("v")).unwrap();
            assert!(vol
                .apply_fs_group(gid, false, FsGroupPolicy::Always)
                .unwrap());
            let st = rustix::fs::statat(&deepest, "..", AtFlags::empty()).unwrap();
            assert_eq!(
                st.st_mode & 0o2070,
                0o2070,
                "the deepest level has the bits"
            );
            // (A directory held open deep in the tree makes each rmdir above it walk the
            // held chain in the kernel.)
            drop((vol, deepest));
            Dir::open(&top).unwrap().remove_dir_all_one_fs("v").unwrap();
        })
        .unwrap()
        .join()
        .unwrap();
    assert!(!v.exists());
}

#[test]
fn a_deep_tree_of_empty_directories_goes_with_rmdir_alone() {
    let _one_at_a_time = crate::walk::tests::deep_trees();
    let t = crate::walk::tests::memory_tempdir();
    let mut cur = rustix::fs::open(t.path(), DIR_FLAGS, Mode::empty()).unwrap();
    for _ in 0..20_000 {
        rustix::fs::mkdirat(&cur, "e", Mode::from_raw_mode(0o755)).unwrap();
        cur = rustix::fs::openat(&cur, "e", DIR_FLAGS, Mode::empty()).unwrap();
    }
    rustix::fs::mkdirat(&cur, "keep", Mode::from_raw_mode(0o755)).unwrap();
    std::fs::write(t.path().join("marker"), b"").unwrap();
    let deep_file = rustix::fs::openat(
        &cur,
        "keep/data",
        OFlags::CREATE | OFlags::WRONLY,
        Mode::from_raw_mode(0o600),
    )
    .unwrap();
    drop(deep_file);
    let d = Dir::open(t.path()).unwrap();
    let e = std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(SMALL_STACK)
            .spawn_scoped(s, || d.remove_empty_tree("e").unwrap_err())
            .unwrap()
            .join()
            .unwrap()
    });
    assert!(
        matches!(&e, MountError::Leftover { path } if path.ends_with("keep/data")),
        "{e}"
    );
    rustix::fs::unlinkat(&cur, "keep/data", AtFlags::empty()).unwrap();
    drop(cur);
    d.remove_empty_tree("e").unwrap();
    assert!(!t.path().join("e").exists());
}
#[test]
fn a_tree_100000_levels_deep_is_walked_with_a_bounded_stack_and_bounded_descriptors() {
    let _one_at_a_time = crate::walk::tests::deep_trees();
    let t = crate::walk::tests::memory_tempdir();
    drop(crate::walk::tests::chain(t.path(), 100_000));
    // A thread with a small stack: recursion would overflow it within a few hundred levels.
    let root = t.path().to_path_buf();
    let walked = std::thread::Builder::new()
        .stack_size(SMALL_STACK)
        .spawn(move || {
            let before = crate::walk::tests::open_descriptors();
            let mut count = crate::walk::tests::Count {
                dirs: 0,
                files: 0,
                deepest: 0,
                open_at_deepest: 0,
            };
            crate::walk::tests::walk_path(&root, &mut count).unwrap();
            (
                count.dirs,
                count.files,
                count.deepest,
                count.open_at_deepest.saturating_sub(before),
            )
        })
        .unwrap()
        .join()
        .unwrap();
    let (dirs, files, deepest, opened) = walked;
    assert_eq!((dirs, files, deepest), (100_000, 100_000, 100_000));
    assert!(
        opened <= crate::walk::OPEN_LIMIT + 2,
        "{opened} descriptors were open at the deepest level"
    );
    // std's own removal recurses: the tree goes with kubevol's.
    Dir::open(t.path())
        .unwrap()
        .remove_contents_one_fs()
        .unwrap();
}
