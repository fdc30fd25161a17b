//! Parsing `/proc/self/mountinfo`, the truth about what is mounted where.

use std::path::PathBuf;

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// The mount's ID.
    pub id: u32,
    /// The parent mount's ID.
    pub parent_id: u32,
    /// `major:minor` of the filesystem's device.
    pub major_minor: String,
    /// The root of the mount inside its filesystem.
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw,nosuid`).
    pub mount_options: String,
    /// The filesystem type (`tmpfs`).
    pub fs_type: String,
    /// The mount source.
    pub source: String,
    /// Per-superblock options (`rw,size=65536k`).
    pub super_options: String,
    /// The optional fields: propagation (`shared:5`, `master:3`, `unbindable`), empty for a
    /// private mount.
    pub optional: String,
}

impl MountInfo {
    /// Whether mounts made below it elsewhere reach it: a shared mount, or a slave of one.
    pub fn receives_propagation(&self) -> bool {
        self.optional
            .split(' ')
            .any(|f| f.starts_with("shared:") || f.starts_with("master:"))
    }

    /// Whether it is shared (in a peer group).
    pub fn is_shared(&self) -> bool {
        self.optional.split(' ').any(|f| f.starts_with("shared:"))
    }
}

/// Undoes the kernel's octal escapes (`\040` for a space) in a mountinfo field.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                out.push((oct[0] - b'0') * 64 + (oct[1] - b'0') * 8 + (oct[2] - b'0'));
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses the whole mount table.
pub fn parse(text: &str) -> Result<Vec<MountInfo>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Result<MountInfo, String> {
    let fields: Vec<&str> = line.split(' ').collect();
    let sep = fields
        .iter()
        .position(|f| *f == "-")
        .ok_or_else(|| format!("no separator in mountinfo line {line:?}"))?;
    if sep < 6 || fields.len() < sep + 4 {
        return Err(format!("short mountinfo line {line:?}"));
    }
    let num = |s: &str| {
        s.parse::<u32>()
            .map_err(|_| format!("bad number in {line:?}"))
    };
    Ok(MountInfo {
        id: num(fields[0])?,
        parent_id: num(fields[1])?,
        major_minor: fields[2].to_string(),
        root: PathBuf::from(unescape(fields[3])),
        mount_point: PathBuf::from(unescape(fields[4])),
        mount_options: fields[5].to_string(),
        fs_type: fields[sep + 1].to_string(),
        source: unescape(fields[sep + 2]),
        super_options: fields[sep + 3].to_string(),
        optional: fields[6..sep].join(" "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_with_optional_fields_and_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    100 36 0:50 / /var/lib/kubevol/pods/x/volumes/kubernetes.io~empty-dir/cache rw,relatime - tmpfs tmpfs rw,size=65536k\n";
        let m = parse(text).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/with space"));
        assert_eq!(m[0].fs_type, "ext3");
        assert_eq!(m[0].root, PathBuf::from("/mnt1"));
        assert_eq!(m[1].fs_type, "tmpfs");
        assert_eq!(m[1].super_options, "rw,size=65536k");
        assert_eq!(m[1].parent_id, 36);
        assert_eq!(m[0].optional, "master:1");
        assert!(m[0].receives_propagation() && !m[0].is_shared());
        assert!(m[1].optional.is_empty() && !m[1].receives_propagation());
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse("nonsense line\n").is_err());
    }

    #[test]
    fn reads_this_process_table() {
        use std::path::Path;
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let m = parse(&text).unwrap();
        assert!(m.iter().any(|e| e.mount_point == Path::new("/")));
    }
}
