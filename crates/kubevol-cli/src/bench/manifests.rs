//! `kubevol bench --manifests MB`: what reading manifests costs, per MB of text, for files
//! that are valid and for files full of what a manifest writer gets wrong (unknown fields, type
//! errors, quoted modes, YAML 1.1 octal modes): each file is parsed as the manifest watch
//! parses it, and beside it the floor, the YAML parser alone reading the same text once. A
//! file costs what its size says, whatever it holds: the ratio to the floor stays small.

use super::*;

/// The text of the `i`th unit of a kind of file (repeated to the file's size).
type Unit = Box<dyn Fn(usize) -> String>;

/// The kinds of file measured: a name, and its unit.
fn units() -> Vec<(&'static str, Unit)> {
    let pod = |i: usize, mode: &str| {
        format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}}}\nspec:\n  containers: [{{name: c, image: i}}]\n  volumes:\n  - name: s\n    secret: {{secretName: s, defaultMode: {mode}}}\n---\n")
    };
    vec![
        ("valid pods", Box::new(move |i| pod(i, "420")) as Unit),
        (
            "pods with octal modes (0644)",
            Box::new(move |i| pod(i, "0644")),
        ),
        (
            "pods with quoted modes (\"0644\")",
            Box::new(move |i| pod(i, "\"0644\"")),
        ),
        (
            "ConfigMaps of 100 unknown fields each",
            Box::new(|i| {
                let unknown: String = (0..100).map(|k| format!("extra{k}: x\n")).collect();
                format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c{i}}}\n{unknown}---\n")
            }),
        ),
        (
            "documents with a type error",
            Box::new(|i| {
                format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c{i}}}\ndata: 5\n---\n")
            }),
        ),
    ]
}

/// Runs the manifest benchmark on files of `mb` MB each.
pub fn run(mb: f64) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        mb > 0.0,
        "--manifests: give the size of each file in MB (e.g. 1)"
    );
    let bytes = (mb * 1e6) as usize;
    println!("kubevol bench --manifests {mb}: one file of each kind, {mb} MB, parsed as the manifest watch parses it, beside the YAML parser alone");
    println!();
    println!(
        "{:<40} {:>8} {:>10} {:>10} {:>12} {:>8}",
        "file", "MB", "objects", "problems", "CPU s / MB", "/ floor"
    );
    for (name, unit) in units() {
        let mut text = String::new();
        let mut i = 0;
        while text.len() < bytes {
            text.push_str(&unit(i));
            i += 1;
        }
        let path = Path::new("/bench/manifest.yaml");
        let floor = {
            let t = cpu_seconds();
            let mut docs = 0;
            for d in serde_yaml_ng::Deserializer::from_str(&text) {
                let v = <serde_yaml_ng::Value as serde::Deserialize>::deserialize(d);
                docs += usize::from(v.is_ok());
            }
            std::hint::black_box(docs);
            cpu_seconds() - t
        };
        let t = cpu_seconds();
        let (objects, errors) = kubevol::source::parse_manifest(path, &text);
        let parsed = cpu_seconds() - t;
        let size = text.len() as f64 / 1e6;
        println!(
            "{name:<40} {size:>8.2} {:>10} {:>10} {:>12.3} {:>8.2}",
            objects.len(),
            errors.len(),
            parsed / size,
            parsed / floor.max(1e-9)
        );
    }
    println!();
    println!("(problems: the file's errors; a file with any error is not applied, and each is located by line and column. floor: the YAML parser reading the text into values, once)");
    Ok(ExitCode::SUCCESS)
}
