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
