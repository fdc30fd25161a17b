//! The kubectl-style table of `kubevol run --once` and `kubevol status`.

use std::io::Write;

use kubevol::status::StatusReport;

/// Prints the report: one row per volume (or per rejected pod), then manifest errors; `wide`
/// adds each pod's recent events.
pub fn print_report(
    report: &StatusReport,
    wide: bool,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let mut rows: Vec<[String; 5]> = vec![[
        "NAMESPACE/POD".into(),
        "VOLUME".into(),
        "TYPE".into(),
        "STATE".into(),
        "PATH OR ERROR".into(),
    ]];
    for pod in &report.pods {
        let name = format!("{}/{}", pod.namespace, pod.name);
        if pod.volumes.is_empty() {
            let detail = if pod.errors.is_empty() {
                "no volumes used by containers".to_string()
            } else {
                format!("{}: {}", pod.source, pod.errors.join("; "))
            };
            rows.push([
                name.clone(),
                "-".into(),
                "-".into(),
                pod.phase.to_string(),
                detail,
            ]);
        }
        for v in &pod.volumes {
            let detail = match (&v.path, &v.retry.last_error) {
                (_, Some(e)) => match v.retry.next_retry_ms {
                    Some(ms) => format!("{e} (retry in {:.1}s)", ms as f64 / 1000.0),
                    None if v.retry.permanent => format!(
                        "{e} (failed for good: tried again when the pod or an object it reads changes)"
                    ),
                    None => e.clone(),
                },
                (Some(p), None) => {
                    if v.read_only {
                        format!("{p} (ro)")
                    } else {
                        p.clone()
                    }
                }
                (None, None) => String::new(),
            };
            rows.push([
                name.clone(),
                v.name.clone(),
                v.type_.clone(),
                v.state.to_string(),
                detail,
            ]);
        }
    }
    write_columns(&rows, out)?;
    if wide {
        for pod in report.pods.iter().filter(|p| !p.events.is_empty()) {
            writeln!(
                out,
                "\nEvents of {}/{} ({}):",
                pod.namespace, pod.name, pod.source
            )?;
            print_events(&pod.events, out)?;
        }
    }
    let warnings: Vec<String> = report
        .pods
        .iter()
        .flat_map(|p| {
            let of_pod = p
                .warnings
                .iter()
                .map(move |w| format!("{}/{}: {w}", p.namespace, p.name));
            let of_volumes = p.volumes.iter().flat_map(move |v| {
                let health = v.health.iter().flat_map(|h| &h.conditions);
                v.warnings
                    .iter()
                    .cloned()
                    .chain(health.map(|c| format!("unhealthy: {c}")))
                    .map(move |w| format!("{}/{} volume {}: {w}", p.namespace, p.name, v.name))
            });
            of_pod.chain(of_volumes)
        })
        .chain(report.manifest_warnings.iter().cloned())
        .collect();
    print_section(out, "\nWarnings:", &warnings)?;
    if report.pods.is_empty() {
        writeln!(out, "\nNo pods for this node ({}).", report.node_name)?;
    }
    print_section(out, "\nNotes:", &report.notes)?;
    print_section(out, "\nClaims bound by kubevol:", &report.bindings)?;
    print_section(out, "\nManifest errors:", &report.manifest_errors)?;
    print_section(out, "\nFound at start:", &report.reconstruction.problems)?;
    let foreign = &report.reconstruction.foreign_pods;
    if !foreign.is_empty() {
        writeln!(
            out,
            "\nForeign pod directories ({}):",
            kubevol::reconstruct::FOREIGN_HINT
        )?;
        for f in foreign {
            let volumes = match f.volumes.len() {
                0 => "no volumes".to_string(),
                _ => f.volumes.join(", "),
            };
            writeln!(out, "  {}: {volumes}", f.path)?;
        }
    }
    if !report.leftovers.is_empty() {
        writeln!(out, "\nOrphaned pod directories kept:")?;
        for l in &report.leftovers {
            writeln!(out, "  {}: {}", l.path, l.reason)?;
        }
    }
    Ok(())
}

/// `heading` and then each item indented on a line of its own; nothing when there are none.
pub(crate) fn print_section<T: std::fmt::Display>(
    out: &mut impl Write,
    heading: &str,
    items: &[T],
) -> std::io::Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    writeln!(out, "{heading}")?;
    for i in items {
        writeln!(out, "  {i}")?;
    }
    Ok(())
}

/// Prints events a line each, repeats folded with their count.
pub fn print_events(
    events: &[kubevol::events::Event],
    out: &mut impl Write,
) -> std::io::Result<()> {
    for e in events {
        let count = if e.count > 1 {
            format!(" (x{})", e.count)
        } else {
            String::new()
        };
        writeln!(
            out,
            "  {:7}  {:24}  {}{count}",
            e.type_, e.reason, e.message
        )?;
    }
    Ok(())
}

/// Prints the CSI drivers (nothing when there are none).
pub fn print_drivers(drivers: &[serde_json::Value], out: &mut impl Write) -> std::io::Result<()> {
    if drivers.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    let mut rows: Vec<[String; 5]> = vec![[
        "CSI DRIVER".into(),
        "NODE ID".into(),
        "CAPABILITIES".into(),
        "ENDPOINT".into(),
        "HEALTH".into(),
    ]];
    for d in drivers {
        let s = |k: &str| d[k].as_str().unwrap_or_default().to_string();
        let caps: Vec<String> = d["capabilities"]
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(_, v)| v.as_bool() == Some(true))
                    .map(|(k, _)| k.to_ascii_uppercase())
                    .collect()
            })
            .unwrap_or_default();
        rows.push([
            s("name"),
            s("node_id"),
            if caps.is_empty() {
                "-".into()
            } else {
                caps.join(",")
            },
            s("endpoint"),
            s("health"),
        ]);
    }
    write_columns(&rows, out)?;
    for d in drivers {
        let warnings: Vec<&str> = d["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|w| w.as_str())
            .collect();
        if !warnings.is_empty() {
            writeln!(
                out,
                "\nRegistrations of {}:",
                d["name"].as_str().unwrap_or_default()
            )?;
            for w in warnings {
                writeln!(out, "  {w}")?;
            }
        }
        let storage: Vec<&serde_json::Value> = d["storage_health"]
            .as_array()
            .into_iter()
            .flatten()
            .collect();
        if !storage.is_empty() {
            writeln!(
                out,
                "\nStorage health of {}:",
                d["name"].as_str().unwrap_or_default()
            )?;
            for c in storage {
                let text = |k: &str| c[k].as_str().unwrap_or_default().to_string();
                writeln!(
                    out,
                    "  {} ({}): {}",
                    text("status"),
                    text("reason"),
                    text("message")
                )?;
            }
        }
    }
    Ok(())
}

/// Writes rows of five columns, each of the first four padded to its widest cell.
pub(crate) fn write_columns(rows: &[[String; 5]], out: &mut impl Write) -> std::io::Result<()> {
    let widths: Vec<usize> = (0..4)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    for r in rows {
        writeln!(
            out,
            "{:w0$}  {:w1$}  {:w2$}  {:w3$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lists_what_was_found_at_start_orphaned_directories_kept_and_bindings() {
        let report = kubevol::status::StatusReport {
            manifest_warnings: vec![],
            node_name: "n".into(),
            root_dir: "/r".into(),
            states_synced: true,
            pods: Vec::new(),
            manifest_errors: Vec::new(),
            notes: vec![
                "1 object of kinds kubevol does not run: Deployment default/web (app.yaml)".into(),
            ],
            reconstruction: kubevol::reconstruct::Reconstruction {
                problems: vec!["record /r/volume-record/pods/u/v.1.json cannot be read".into()],
                ..Default::default()
            },
            leftovers: vec![kubevol::reconstruct::Leftover {
                uid: "u".into(),
                path: "/r/pods/u".into(),
                reason: "orphaned pod directory kept: /r/pods/u/notes.txt".into(),
            }],
            bindings: vec![
                kubevol::status::BindingStatus {
                    claim: "default/data".into(),
                    volume: "pv-small".into(),
                    phase: "Bound".into(),
                },
                kubevol::status::BindingStatus {
                    claim: "default/gone".into(),
                    volume: "pv-kept".into(),
                    phase: "Released".into(),
                },
            ],
        };
        let mut out = Vec::new();
        print_report(&report, false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("No pods for this node (n).\n\nNotes:\n  1 object of kinds kubevol does not run: Deployment default/web (app.yaml)\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "Found at start:\n  record /r/volume-record/pods/u/v.1.json cannot be read"
            ),
            "{text}"
        );
        assert!(
            text.contains("Orphaned pod directories kept:\n  /r/pods/u: orphaned pod directory kept: /r/pods/u/notes.txt"),
            "{text}"
        );
        assert!(
            text.contains("Claims bound by kubevol:\n  default/data -> pv-small\n  default/gone -> pv-kept (Released: the claim is gone; the volume keeps its data and is kept for a claim of that name)\n"),
            "{text}"
        );
    }

    #[test]
    fn drivers_table_shows_node_id_capabilities_endpoint_and_health() {
        let drivers: Vec<serde_json::Value> = serde_json::from_value(serde_json::json!([
            {"name": "loop.csi.kubevol.io", "endpoint": "/run/csi.sock", "node_id": "node-1",
             "capabilities": {"stage_unstage_volume": true, "get_volume_stats": false, "expand_volume": true},
             "health": "healthy"},
            {"name": "other.example.com", "endpoint": "/run/o.sock", "node_id": "n",
             "capabilities": {}, "health": "CSI driver other.example.com: NodeStageVolume failed: Unavailable (gone)",
             "warnings": ["a registration of other.example.com at /run/p.sock was refused: why"]}
        ]))
        .unwrap();
        let mut out = Vec::new();
        print_drivers(&drivers, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "");
        assert!(
            lines[1].starts_with("CSI DRIVER") && lines[1].contains("HEALTH"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("loop.csi.kubevol.io")
                && lines[2].contains("node-1")
                && lines[2].contains("EXPAND_VOLUME,STAGE_UNSTAGE_VOLUME")
                && !lines[2].contains("GET_VOLUME_STATS")
                && lines[2].ends_with("healthy"),
            "{text}"
        );
        assert!(
            lines[3].contains(" - ") && lines[3].ends_with("Unavailable (gone)"),
            "{text}"
        );
        assert_eq!(
            &lines[4..],
            [
                "",
                "Registrations of other.example.com:",
                "  a registration of other.example.com at /run/p.sock was refused: why"
            ],
            "{text}"
        );
        let mut none = Vec::new();
        print_drivers(&[], &mut none).unwrap();
        assert!(none.is_empty(), "no drivers, no table");
    }
}
