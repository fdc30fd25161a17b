//! `kubevol describe pod|node`: a pod's volumes, each with the chain of what it depends on and
//! the step it is stuck on, or the node's summary, from the daemon's describe API.

use std::io::Write;

use kubevol::describe::{NodeDescription, PodDescription, StepState};
use kubevol::status::VolumePhase;

/// The marker of a step's state.
fn marker(s: StepState) -> &'static str {
    match s {
        StepState::Done => "[ok]",
        StepState::Waiting => "[..]",
        StepState::Failed => "[!!]",
    }
}

/// Prints a pod's description.
pub fn print_pod(d: &PodDescription, out: &mut impl Write) -> std::io::Result<()> {
    let s = &d.status;
    writeln!(out, "Pod:     {}/{} (uid {})", s.namespace, s.name, s.uid)?;
    writeln!(out, "Source:  {}", s.source)?;
    writeln!(out, "Phase:   {}", s.phase)?;
    for e in &s.errors {
        writeln!(out, "Error:   {e}")?;
    }
    writeln!(out, "Volumes:")?;
    for v in &s.volumes {
        let chain = d.chains.iter().find(|c| c.volume == v.name);
        if v.state == VolumePhase::Mounted {
            let ro = if v.read_only { " (ro)" } else { "" };
            writeln!(
                out,
                "  {} ({}): ready at {}{ro}",
                v.name,
                v.type_,
                v.path.as_deref().unwrap_or("-")
            )?;
            continue;
        }
        let why = chain
            .and_then(|c| c.waiting_for.clone())
            .or_else(|| v.retry.last_error.clone())
            .unwrap_or_default();
        writeln!(out, "  {} ({}): {:?}: {why}", v.name, v.type_, v.state)?;
        for st in chain.map(|c| c.steps.as_slice()).unwrap_or_default() {
            writeln!(
                out,
                "    {} {:<34} {}",
                marker(st.state),
                st.step,
                st.detail
            )?;
            if let Some(e) = &st.error {
                writeln!(out, "         error: {e}")?;
            }
        }
        if v.retry.failures > 0 {
            let next = match (v.retry.permanent, v.retry.next_retry_ms) {
                (true, _) => "tried again when the pod or an object it reads changes".to_string(),
                (false, Some(ms)) => format!("next try in {:.1}s", ms as f64 / 1000.0),
                (false, None) => "being tried again".to_string(),
            };
            writeln!(out, "    attempts: {} failed; {next}", v.retry.failures)?;
        }
        for w in &v.warnings {
            writeln!(out, "    warning: {w}")?;
        }
    }
    crate::table::print_section(out, "Warnings:", &s.warnings)?;
    if !s.events.is_empty() {
        writeln!(out, "Events:")?;
        crate::table::print_events(&s.events, out)?;
    }
    Ok(())
}

/// Prints the node's description.
pub fn print_node(d: &NodeDescription, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "Node:     {}", d.node_name)?;
    writeln!(out, "Root:     {}", d.root_dir)?;
    writeln!(
        out,
        "Synced:   {}",
        if d.states_synced {
            "yes"
        } else {
            "not yet (nothing is torn down until every source has listed its pods)"
        }
    )?;
    let sources: Vec<String> = d
        .sources
        .iter()
        .map(|(n, synced)| {
            format!(
                "{} ({})",
                source_name(n),
                if *synced { "listed" } else { "not listed yet" }
            )
        })
        .collect();
    writeln!(out, "Sources:  {}", sources.join(", "))?;
    let counts = |c: &[(String, usize)]| {
        c.iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    writeln!(out, "Pods:     {}", counts(&d.pods_by_phase))?;
    writeln!(out, "Volumes:  {}", counts(&d.volumes_by_state))?;
    let drivers: Vec<String> = d
        .drivers
        .iter()
        .map(|v| {
            format!(
                "{} ({})",
                v["name"].as_str().unwrap_or("?"),
                v["health"].as_str().unwrap_or("?")
            )
        })
        .collect();
    if !drivers.is_empty() {
        writeln!(out, "Drivers:  {}", drivers.join(", "))?;
    }
    if !d.volumes_in_use.is_empty() {
        writeln!(out, "In use:   {}", d.volumes_in_use.join(", "))?;
    }
    if !d.volumes_attached.is_empty() {
        writeln!(out, "Attached: {}", d.volumes_attached.join(", "))?;
    }
    for (title, lines) in [
        ("Not ready:", &d.not_ready),
        ("Manifest errors:", &d.manifest_errors),
        ("Notes:", &d.notes),
        ("Found at start:", &d.reconstruction.problems),
    ] {
        crate::table::print_section(out, title, lines)?;
    }
    let r = &d.reconstruction;
    writeln!(
        out,
        "Record:   {} pod volumes and {} node-wide volumes found at start ({} from the pods directory only), in {} ms",
        r.pod_volumes, r.devices, r.from_layout, r.took_ms
    )?;
    for f in &r.foreign_pods {
        writeln!(
            out,
            "Foreign:  {} ({} volumes), left alone",
            f.path,
            f.volumes.len()
        )?;
    }
    for l in &d.leftovers {
        writeln!(out, "Leftover: {}: {}", l.path, l.reason)?;
    }
    Ok(())
}

/// What a pod source is, in words (the store knows them by short names).
fn source_name(name: &str) -> String {
    match name {
        kubevol::source::ManifestSource::NAME => "manifest directory".into(),
        kubevol::source::ClusterSource::NAME => "API server".into(),
        kubevol::source::Library::NAME => "pods given by calls (library API)".into(),
        other => other.into(),
    }
}
