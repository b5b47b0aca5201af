//! The machinery of the settings table (`settings`): where a value came from ([`Origin`]),
//! the file's sections in their validation order ([`Section`]), how a value is shown and
//! written back ([`SettingValue`], [`WrittenValue`]), how several flags or fields of one
//! setting combine ([`agree`], [`agree_field`], [`any`]), and [`settings!`], the macro that
//! turns the table's rows into the flags, the reading of the file, the precedence and the
//! written-back document.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use serde_yaml_ng::Value;

use super::go::format_go_duration;
use super::values::{ClusterCidrs, NodePortAddresses, ServerAddress};
use crate::datapath::loader::KernelLogLevel;
use crate::datapath::tc::XdpSetting;
use crate::model::NorthSouthMode;
use crate::model::bypass::SocketLbScope;

/// The help heading of kube-proxy's flags (those without a name of ebpf-proxy's own).
pub(super) const KUBE_PROXY_FLAGS: &str = "kube-proxy flags";

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Origin {
    /// A flag given on the command line.
    Flag,
    /// The configuration file.
    File,
    /// Neither: the default.
    #[default]
    Default,
}

/// The parts of the configuration file, in the order its validation reads them (which
/// decides which of several errors is reported).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Section {
    /// The top level's `bindAddress`, read before the server addresses.
    BindAddress,
    /// The top level's other fields.
    TopLevel,
    /// The sync periods of the `iptables`, `nftables` and `ipvs` sections.
    SyncPeriods,
    /// The other fields of the `iptables`, `nftables` and `ipvs` sections.
    ModeSections,
    /// `conntrack`.
    Conntrack,
}

/// A setting's value type: how messages show it.
pub trait SettingValue: Clone + PartialEq {
    /// The value as a message shows it (durations in Go's notation, names as flags take
    /// them).
    fn show(&self) -> String;
}

/// The value type of a setting the file gives: how the written-back document holds it.
pub trait WrittenValue: SettingValue {
    /// The type of its `KubeProxyConfiguration` fields.
    type Field: Clone;
    /// The value as the written-back document holds it.
    fn field(&self) -> Self::Field;
}

impl SettingValue for Duration {
    fn show(&self) -> String {
        format_go_duration(*self)
    }
}

impl WrittenValue for Duration {
    type Field = Option<Value>;
    fn field(&self) -> Option<Value> {
        Some(Value::String(format_go_duration(*self)))
    }
}

impl SettingValue for u32 {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl WrittenValue for u32 {
    type Field = Option<Value>;
    fn field(&self) -> Option<Value> {
        Some(Value::Number((*self).into()))
    }
}

impl SettingValue for i32 {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl WrittenValue for i32 {
    type Field = Option<Value>;
    fn field(&self) -> Option<Value> {
        Some(Value::Number((*self).into()))
    }
}

impl SettingValue for bool {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl WrittenValue for bool {
    type Field = Option<bool>;
    fn field(&self) -> Option<bool> {
        Some(*self)
    }
}

impl SettingValue for ClusterCidrs {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for NodePortAddresses {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for String {
    fn show(&self) -> String {
        self.clone()
    }
}

impl SettingValue for IpAddr {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl SettingValue for ServerAddress {
    fn show(&self) -> String {
        match self {
            ServerAddress::Disabled => String::new(),
            ServerAddress::Ip(ip) => ip.to_string(),
            ServerAddress::Addr(a) => a.to_string(),
        }
    }
}

impl SettingValue for PathBuf {
    fn show(&self) -> String {
        self.display().to_string()
    }
}

impl SettingValue for Vec<String> {
    fn show(&self) -> String {
        self.join(",")
    }
}

impl SettingValue for NorthSouthMode {
    fn show(&self) -> String {
        self.name().to_string()
    }
}

/// [`SettingValue`] of the flags' enums, by the names clap takes.
macro_rules! value_enum_settings {
    ($($t:ty),*) => {$(
        impl SettingValue for $t {
            fn show(&self) -> String {
                clap::ValueEnum::to_possible_value(self)
                    .map(|v| v.get_name().to_string())
                    .unwrap_or_default()
            }
        }
    )*};
}

value_enum_settings!(SocketLbScope, KernelLogLevel, XdpSetting);

/// The one value of a setting given by several flags (kube-proxy's per-mode names of one
/// setting, by field name): they must agree.
pub(super) fn agree<T: SettingValue>(given: &[(&str, Option<T>)]) -> Result<Option<T>> {
    let flag = |field: &str| format!("--{}", field.replace('_', "-"));
    let mut found: Option<(&str, &T)> = None;
    for (name, v) in given {
        let Some(v) = v else { continue };
        match found {
            Some((first, f)) if f != v => bail!(
                "{} {} differs from {} {}; give one value",
                flag(name),
                v.show(),
                flag(first),
                f.show()
            ),
            Some(_) => {}
            None => found = Some((*name, v)),
        }
    }
    Ok(found.map(|(_, v)| v.clone()))
}

/// The value of a setting read so far from the file's fields (`found`, with the field that
/// gave it) and the next field's (`path`, `v`): they must agree.
pub(super) fn agree_field<T: SettingValue>(
    found: Option<(&'static str, T)>,
    path: &'static str,
    v: Option<T>,
) -> Result<Option<(&'static str, T)>> {
    match (found, v) {
        (Some((first, f)), Some(v)) if f != v => bail!(
            "{path}: {} differs from {first} ({}); give one value",
            v.show(),
            f.show()
        ),
        (Some(f), _) => Ok(Some(f)),
        (None, v) => Ok(v.map(|v| (path, v))),
    }
}

/// A combination of a setting's file fields (a row's `combine`): true when any field that
/// is set is true, `None` when none is set.
pub(super) fn any(
    found: Option<(&'static str, bool)>,
    path: &'static str,
    v: Option<bool>,
) -> Option<(&'static str, bool)> {
    match (found, v) {
        (Some((first, a)), Some(b)) => Some((first, a | b)),
        (found, None) => found,
        (None, Some(b)) => Some((path, b)),
    }
}

/// Makes the table's types and functions; see the module's documentation. A row:
///
/// ```text
/// /// What the setting is.
/// name: Type => field.of.AgentConfig {
///     default: expression,
///     into: |value: Type| the field's value,                           (optional)
///     flags: { /// help
///              #[arg(...)] flag_name, ... },        (or flag_name: Type: see below)
///     unset: |value: &Type| a flag's value that means "not given",    (optional)
///     check: |value: &Type| -> Result<()> a flag's value refused,       (optional)
///     file: Section reader => ["yaml.path" = document.field, ...],   (optional, with:)
///     combine: how several fields combine,                              (optional)
///     written: |&field, origin| the document's field,                  (optional)
/// }
/// ```
///
/// A flag is `Option<Type>`, `None` unless given, unless it names a type of its own
/// (`flag_name: Type`, e.g. a `bool` with a clap `default_value`, or a `Vec` that is empty
/// when left out): then its value is always taken as given.
///
/// `into` turns a value given into the field's type (the same type without it), so the
/// default is of the field's type.
///
/// `check` refuses a value given by the flags (not by the file, whose reader checks its
/// own), with an error that names the flag.
///
/// A row without `file` is a setting of the flags alone (`KubeProxyConfiguration` has no
/// field for it: it is neither read nor written back).
///
/// `reader` is called with the field's dotted path and its value in the document and
/// returns the setting's value (`None`: unset) or an error naming the path; several fields
/// must agree, unless `combine` (such as [`any`]) says how they combine. Every field listed
/// is written back, by [`WrittenValue::field`] unless `written` says otherwise.
macro_rules! settings {
    // The flags' struct, one field at a time: clap's derive must see the field's type
    // itself (`Option<..>`, `Vec<..>`), not a macro that makes it.
    (@flag_fields [$($fields:tt)*]) => {
        /// The flags of the settings of [`settings`](self), each `None` unless given (a flag
        /// of a type of its own, such as a `bool` with a clap default, always has a value).
        #[derive(clap::Args, Debug, Clone, Default)]
        pub struct SettingFlags { $($fields)* }
    };
    (@flag_fields [$($fields:tt)*] [$($attrs:tt)*] $flag:ident [$ty:ty] [$flag_ty:ty]; $($rest:tt)*) => {
        settings!(@flag_fields [$($fields)* $($attrs)* pub $flag: $flag_ty,] $($rest)*);
    };
    (@flag_fields [$($fields:tt)*] [$($attrs:tt)*] $flag:ident [$ty:ty]; $($rest:tt)*) => {
        settings!(@flag_fields [$($fields)* $($attrs)* pub $flag: Option<$ty>,] $($rest)*);
    };
    (@given $v:expr) => { Option::clone(&$v) };
    (@given $v:expr, $flag_ty:ty) => { Some(Clone::clone(&$v)) };
    (@keep $v:ident) => { $v };
    (@keep $v:ident, $unset:expr) => { $v.filter(|v| !($unset)(v)) };
    (@get $doc:ident $field:ident) => { &$doc.$field };
    (@get $doc:ident $section:ident . $field:ident) => {
        $doc.$section.as_ref().map_or(&None, |s| &s.$field)
    };
    (@get_mut $doc:ident $field:ident) => { &mut $doc.$field };
    (@get_mut $doc:ident $section:ident . $field:ident) => {
        &mut $doc.$section.get_or_insert_with(Default::default).$field
    };
    (@next $found:ident, $path:ident, $v:ident) => { agree_field($found, $path, $v) };
    (@next $found:ident, $path:ident, $v:ident, $combine:expr) => {
        Ok($combine($found, $path, $v))
    };
    (@into $v:ident) => { $v };
    (@into $v:ident, $into:expr) => { ($into)($v) };
    (@written $v:expr, $origin:expr) => { WrittenValue::field($v) };
    (@written $v:expr, $origin:expr, $written:expr) => { ($written)($v, $origin) };
    ($(
        $(#[$doc:meta])*
        $name:ident: $ty:ty => $($config:ident).+ {
            default: $default:expr,
            $( into: $into:expr, )?
            flags: { $( $(#[$flag_attr:meta])* $flag:ident $(: $flag_ty:ty)? ),+ $(,)? },
            $( unset: $unset:expr, )?
            $( check: $check:expr, )?
            $(
                file: $section:ident $read:expr => [ $( $yaml:literal = $($path:ident).+ ),+ $(,)? ],
                $( combine: $combine:expr, )?
                $( written: $written:expr, )?
            )?
        }
    ),* $(,)?) => {
        settings!(@flag_fields []
            $( $( [$(#[$flag_attr])*] $flag [$ty] $([$flag_ty])?; )+ )*
        );

        /// What the flags or the configuration file give of each setting of
        /// [`settings`](self): `None` where they leave it unset.
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct SettingValues {
            $(
                $(#[$doc])*
                pub $name: Option<$ty>,
            )*
        }

        /// Where each setting of [`settings`](self) came from.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Origins {
            $(
                $(#[$doc])*
                pub $name: Origin,
            )*
        }

        impl SettingFlags {
            /// The value of each setting the flags give (a value that means "not given"
            /// left out).
            ///
            /// Errors: flags of one setting that disagree, or a value its `check` refuses
            /// (the first row's error, in the table's order).
            pub(super) fn given(&self) -> Result<SettingValues> {
                Ok(SettingValues {
                    $( $name: {
                        let keep = |v: Option<$ty>| settings!(@keep v $(, $unset)?);
                        let value = agree(&[ $(
                            (stringify!($flag), keep(settings!(@given self.$flag $(, $flag_ty)?))),
                        )+ ])?;
                        $( if let Some(v) = &value {
                            ($check)(v)?;
                        } )?
                        value
                    }, )*
                })
            }
        }

        impl SettingValues {
            /// Reads the settings of `section` from the document, checking each value.
            ///
            /// Errors: a value its reader refuses, or fields of one setting that disagree;
            /// the message starts with the field's dotted path.
            pub(super) fn read(
                &mut self,
                doc: &KubeProxyConfiguration,
                section: Section,
            ) -> Result<()> {
                $( $( if section == Section::$section {
                    let next = |found: Option<(&'static str, $ty)>,
                                path: &'static str,
                                v: Option<$ty>|
                     -> Result<Option<(&'static str, $ty)>> {
                        settings!(@next found, path, v $(, $combine)?)
                    };
                    let mut found = None;
                    $(
                        found = next(found, $yaml, ($read)($yaml, settings!(@get doc $($path).+))?)?;
                    )+
                    self.$name = found.map(|(_, v)| v);
                } )? )*
                Ok(())
            }
        }

        /// Sets each setting of `c`: the flag given (`flags`), else the file's value
        /// (`file`), else the default.
        pub(super) fn apply(
            c: &mut AgentConfig,
            flags: &SettingValues,
            file: &SettingValues,
        ) -> Origins {
            let mut origins = Origins::default();
            $(
                (c.$($config).+, origins.$name) =
                    match (Option::clone(&flags.$name), Option::clone(&file.$name)) {
                    (Some(v), _) => (settings!(@into v $(, $into)?), Origin::Flag),
                    (None, Some(v)) => (settings!(@into v $(, $into)?), Origin::File),
                    (None, None) => ($default, Origin::Default),
                };
            )*
            origins
        }

        /// The `KubeProxyConfiguration` fields of the table, by dotted path.
        #[cfg(test)]
        pub(super) const FIELDS: &[&str] = &[$( $( $($yaml,)+ )? )*];

        /// Writes each setting of `c` into its fields of `doc`.
        pub(super) fn write(c: &AgentConfig, origins: &Origins, doc: &mut KubeProxyConfiguration) {
            $( {
                #[allow(unused_variables)]
                let value = &c.$($config).+;
                $(
                    let field = settings!(@written value, origins.$name $(, $written)?);
                    $( *settings!(@get_mut doc $($path).+) = field.clone(); )+
                )?
            } )*
        }
    };
}

pub(super) use settings;
