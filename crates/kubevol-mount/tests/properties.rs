//! Property tests of the mount table's parser: whatever a line holds, it is parsed or refused,
//! never a panic, and the kernel's escapes of a mount point read back as the path.

use kubevol_mount::mountinfo;
use proptest::prelude::*;

/// Escapes `s` as the kernel writes a path in mountinfo (space, tab, newline and backslash
/// as octal).
fn kernel_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

proptest! {
    #[test]
    fn any_text_is_parsed_or_refused(text in any::<String>()) {
        let _ = mountinfo::parse(&text);
    }

    #[test]
    fn lines_of_tokens_are_parsed_or_refused(
        tokens in prop::collection::vec(prop::sample::select(vec!["36", "35", "98:0", "/", "/mnt", "-", "rw", "shared:1", "ext4", "/dev/x", "", "\\040", "master:2"]), 0..16)
    ) {
        let _ = mountinfo::parse(&tokens.join(" "));
    }

    #[test]
    fn an_escaped_mount_point_reads_back_as_the_path(
        name in prop::collection::vec(prop::sample::select(vec!['a', ' ', '\t', '\n', '\\', 'é', '0', '-']), 1..40)
    ) {
        let path = format!("/mnt/{}", name.into_iter().collect::<String>());
        let line = format!("36 35 98:0 / {} rw,noatime shared:1 - tmpfs tmpfs rw\n", kernel_escape(&path));
        let parsed = mountinfo::parse(&line).expect("a well-formed line");
        prop_assert_eq!(parsed.len(), 1);
        prop_assert_eq!(parsed[0].mount_point.to_str(), Some(path.as_str()));
    }
}

/// A directory to pin paths beneath, beside one outside it: inside, `a/b`, a link to `a` (stays
/// inside), an absolute link to the outside, a relative link climbing out, and a link to
/// `/proc/self/root` (a magic link, which can lead anywhere).
fn pin_fixture() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base");
    let outside = t.path().join("outside");
    std::fs::create_dir_all(base.join("a/b")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink("a", base.join("in")).unwrap();
    std::os::unix::fs::symlink(&outside, base.join("abs")).unwrap();
    std::os::unix::fs::symlink("../outside", base.join("up")).unwrap();
    std::os::unix::fs::symlink("/proc/self/root", base.join("magic")).unwrap();
    (t, base, outside)
}

proptest! {
    /// Whatever relative path a hostPath names below an allowed directory, pinning it opens
    /// (and makes) something beneath that directory or nothing: never the outside, never a
    /// directory made outside.
    #[test]
    fn a_pinned_path_never_leads_out_of_the_allowed_directory(
        names in prop::collection::vec(prop::sample::select(vec!["a", "b", "c", "..", ".", "in", "abs", "up", "magic", "etc", ""]), 0..6),
        make in prop::sample::select(vec![
            kubevol_mount::pin::Missing::Refuse,
            kubevol_mount::pin::Missing::Directories,
            kubevol_mount::pin::Missing::File,
        ]),
    ) {
        use std::os::fd::AsRawFd;
        let (_t, base, outside) = pin_fixture();
        let dir = kubevol_mount::safe::Dir::open(&base).unwrap();
        let rel = names.join("/");
        if let Ok((fd, _)) = kubevol_mount::pin::open_pinned(&dir, std::path::Path::new(&rel), make) {
            let at = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
            prop_assert!(at.starts_with(&base), "{rel:?} opened {}", at.display());
        }
        prop_assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing made outside for {:?}", rel);
    }
}
