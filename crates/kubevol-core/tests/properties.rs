//! Property tests of what turns hostile strings (from manifests, the API server, a volume)
//! into paths, quantities and mount options: whatever the input, the constructor either
//! refuses it or gives something that holds the property the node relies on.

use std::path::{Component, Path};

use kubevol_core::names::PathName;
use kubevol_core::quantity::Quantity;
use kubevol_core::selinux;
use kubevol_core::validation::{clean_item_path, item_path_errors, mount_option_error};
use proptest::prelude::*;

/// Strings of the characters that matter to paths, options and numbers, up to 300 bytes,
/// or any string at all.
fn hostile() -> impl Strategy<Value = String> {
    let chars = prop::sample::select(vec![
        'a', 'z', '0', '9', '.', '/', '\\', '\0', '"', '\'', ',', ':', '=', '-', '_', ' ', '\n',
        '\t', 'é', 'K', 'i', 'M', 'e', '+', 'm', 'n',
    ]);
    prop_oneof![
        prop::collection::vec(chars, 0..300).prop_map(|c| c.into_iter().collect()),
        any::<String>(),
    ]
}

/// Strings made of `chars`, mostly, else hostile ones.
fn mostly(chars: &'static str) -> impl Strategy<Value = String> {
    let valid = prop::collection::vec(
        prop::sample::select(chars.chars().collect::<Vec<_>>()),
        1..20,
    )
    .prop_map(|c| c.into_iter().collect::<String>());
    prop_oneof![3 => valid, 1 => hostile()]
}

/// The options the kernel (and `mount -o`) reads from an option string: split at commas
/// outside double quotes.
fn kernel_options(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

proptest! {
    #[test]
    fn a_path_name_is_exactly_one_component_of_its_directory(s in hostile()) {
        match PathName::new("the name", &s) {
            Ok(name) => {
                let components: Vec<Component<'_>> = Path::new(name.as_str()).components().collect();
                prop_assert_eq!(components.len(), 1);
                prop_assert!(matches!(components[0], Component::Normal(n) if n == s.as_str()));
                prop_assert!(s.len() <= 255 && !s.contains('\0'));
                let joined = Path::new("/root").join(&name);
                prop_assert_eq!(joined.parent(), Some(Path::new("/root")));
            }
            Err(e) => {
                prop_assert!(s.is_empty() || s == "." || s == ".." || s.contains('/') || s.contains('\0') || s.len() > 255);
                prop_assert!(e.value.chars().count() <= 80);
            }
        }
    }

    #[test]
    fn any_string_is_a_quantity_or_refused(s in hostile()) {
        if let Ok(q) = Quantity::parse(&s) {
            // Printed as its value, which reads back as the same value.
            prop_assert_eq!(Quantity::parse(&q.to_string()).map(|again| again.value()), Ok(q.value()));
        }
    }

    #[test]
    fn a_quantity_is_its_number_times_its_suffix_rounded_up(
        n in any::<u32>(),
        (suffix, times, per) in prop::sample::select(vec![
            ("", 1u128, 1u128), ("Ki", 1 << 10, 1), ("Mi", 1 << 20, 1), ("Gi", 1 << 30, 1),
            ("k", 1000, 1), ("M", 1_000_000, 1), ("m", 1, 1000), ("e3", 1000, 1), ("E-2", 1, 100),
        ]),
    ) {
        let q = Quantity::parse(&format!("{n}{suffix}")).expect("a quantity");
        let want = (u128::from(n) * times).div_ceil(per);
        prop_assert_eq!(q.value() as u128, want);
    }

    #[test]
    fn a_context_option_is_one_option_holding_the_label(label in hostile()) {
        if let Some(option) = selinux::context_option(&label) {
            prop_assert_eq!(kernel_options(&option), vec![format!("context=\"{label}\"")]);
            prop_assert!(!label.contains(['"', '\\', '\n', '\0']));
        }
    }

    #[test]
    fn selinux_options_that_pass_make_a_label_that_is_one_option(
        user in mostly("abz_.-09"),
        role in mostly("abz_.-09"),
        type_ in mostly("abz_.-09"),
        level in mostly("s0c1:,.-"),
    ) {
        let opts = k8s_openapi::api::core::v1::SELinuxOptions {
            user: Some(user), role: Some(role), type_: Some(type_), level: Some(level),
        };
        if kubevol_core::validation::selinux_options_errors(&opts).is_empty() {
            if let Some(label) = selinux::file_label(selinux::DEFAULT_FILE_CONTEXT, &opts) {
                let option = selinux::context_option(&label);
                prop_assert!(option.is_some(), "{}", label);
                prop_assert_eq!(kernel_options(&option.unwrap()).len(), 1);
            }
        }
    }

    #[test]
    fn a_mount_option_that_passes_never_swallows_its_neighbours(option in hostile()) {
        if mount_option_error(&option).is_none() {
            let options = kernel_options(&format!("ro,{option},nodev"));
            prop_assert_eq!(options.first().map(String::as_str), Some("ro"));
            prop_assert_eq!(options.last().map(String::as_str), Some("nodev"));
            prop_assert!(!option.contains(['\0', '\n']));
        }
    }

    #[test]
    fn an_item_path_that_passes_stays_below_its_volume(p in hostile()) {
        if item_path_errors(&p).is_empty() {
            let clean = clean_item_path(&p);
            prop_assert!(!clean.starts_with(".."), "{}", clean);
            prop_assert!(clean.len() <= 4096);
            for c in Path::new(&clean).components() {
                prop_assert!(matches!(c, Component::Normal(n) if n.len() <= 255 && n != ".."), "{:?} of {}", c, clean);
            }
        }
    }
}

/// Fixed cases beside the properties above, which hold of a validator that refuses everything:
/// what must pass passes, and what must be refused is.
#[test]
fn the_properties_checks_take_what_is_good_and_refuse_what_is_not() {
    for good in ["noatime", "ro", "context=\"a,b\"", "vers=4.1", "uid=1000"] {
        assert_eq!(mount_option_error(good), None, "{good}");
    }
    for bad in ["a\"", "", "a\nb", "x\0y", "\"a,b"] {
        assert!(mount_option_error(bad).is_some(), "{bad:?}");
    }
    let label = "system_u:object_r:container_file_t:s0:c1,c2";
    assert_eq!(
        selinux::context_option(label).as_deref(),
        Some("context=\"system_u:object_r:container_file_t:s0:c1,c2\"")
    );
    for bad in ["a\"b", "a\nb", "a\\b"] {
        assert_eq!(selinux::context_option(bad), None, "{bad:?}");
    }
    let good = k8s_openapi::api::core::v1::SELinuxOptions {
        user: Some("system_u".into()),
        role: Some("object_r".into()),
        type_: Some("container_t".into()),
        level: Some("s0:c1,c2".into()),
    };
    assert!(kubevol_core::validation::selinux_options_errors(&good).is_empty());
    let smuggling = k8s_openapi::api::core::v1::SELinuxOptions {
        level: Some("s0\",ro".into()),
        ..good.clone()
    };
    assert!(!kubevol_core::validation::selinux_options_errors(&smuggling).is_empty());
    for good in ["a", "a/b", "./a//b/", "key.txt"] {
        assert!(item_path_errors(good).is_empty(), "{good}");
    }
    for bad in ["/a", "../a", "a/../b", "..a"] {
        assert!(!item_path_errors(bad).is_empty(), "{bad}");
    }
    assert!(PathName::new("a name", "pvc-0b3f").is_ok());
    assert!(PathName::new("a name", "a/b").is_err());
}
