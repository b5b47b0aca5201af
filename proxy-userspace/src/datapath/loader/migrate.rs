//! Pins of another version: maps whose layout changed are created anew, an earlier
//! version's id-only `BACKEND_SLOTS` is carried over into this version's layout, and the
//! hints of `SOCK_NAT_SPILLED` are seeded from what earlier versions left.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::EbpfLoader;
use proxy_common::{
    BACKEND_SLOTS, BACKENDS, REVNAT_SK, SOCK_NAT, SOCK_NAT_OVERFLOW, SOCK_NAT_SPILLED,
    SPILLED_LEGACY, SPILLED_OVERFLOW,
};

use super::{FIXED_INDEX_MAPS, OBJECT, map_type, pinned_maps};
use crate::datapath::batch;

/// What the migrations found before the load, for the load's sizes and for after it.
pub(super) struct Migration {
    /// Where an earlier version's id-only slots were set aside ([`SLOT_IDS_PIN`]).
    ids_pin: PathBuf,
    /// The pins are a version's without slots (no `SOCK_NAT`, a `REVNAT_SK`).
    without_slots: bool,
    /// `SOCK_NAT_SPILLED` is created next to an adopted `SOCK_NAT_OVERFLOW`.
    seed_overflow: bool,
}

/// Before the load: an earlier version's id-only slots set aside, incompatible pins
/// removed (each with a warning), and what the pins say of the version that made them.
pub(super) fn before_load(dir: &Path) -> Result<Migration> {
    // An earlier version's slots hold backend ids only: their pin is set aside (not
    // removed) and carried over into the new layout after the load, before any program is
    // attached, so every Service keeps its backends until the first sync. A start that
    // fails or dies before the carry-over finds the set-aside pin again.
    let ids_pin = dir.join(SLOT_IDS_PIN);
    if id_only_slots(&dir.join(BACKEND_SLOTS)) {
        fs::rename(dir.join(BACKEND_SLOTS), &ids_pin)
            .with_context(|| format!("pin: set aside {}", ids_pin.display()))?;
    }
    for (name, why) in replace_incompatible_pins(dir)? {
        tracing::warn!(map = name, %why, "a pinned map has another layout than this version's (pinned by another version, older or newer): it is created anew and its entries are lost; the old programs keep the old map until their links are replaced");
    }
    // The pins of a version without slots: its connect programs may still write connected
    // entries to `REVNAT_SK` until their links are replaced.
    let without_slots = !dir.join(SOCK_NAT).exists() && dir.join(REVNAT_SK).exists();
    // Hints created anew next to an adopted overflow map start from its entries.
    let seed_overflow =
        !dir.join(SOCK_NAT_SPILLED).exists() && dir.join(SOCK_NAT_OVERFLOW).exists();
    Ok(Migration {
        ids_pin,
        without_slots,
        seed_overflow,
    })
}

impl Migration {
    /// Slots carried over keep the earlier map's size, as an adopted map would.
    pub(super) fn size_carried_slots(&self, dir: &Path, loader: &mut EbpfLoader<'_>) {
        if !dir.join(BACKEND_SLOTS).exists()
            && let Ok(info) = aya::maps::MapInfo::from_pin(&self.ids_pin)
        {
            loader.map_max_entries(BACKEND_SLOTS, info.max_entries());
        }
    }

    /// After the load (maps in place, no program attached): the set-aside slots carried
    /// over, and the hints of `SOCK_NAT_SPILLED` set from what earlier versions left.
    ///
    /// Errors: a pinned map cannot be opened, read or written (a failed carry-over is a
    /// warning: the set-aside pin stays for the next start).
    pub(super) fn after_load(&self, dir: &Path) -> Result<()> {
        let ids_pin = &self.ids_pin;
        if ids_pin.exists() {
            match carry_slots(dir, ids_pin) {
                Ok(n) => {
                    tracing::info!(
                        slots = n,
                        "carried the earlier version's BACKEND_SLOTS over"
                    );
                    fs::remove_file(ids_pin)
                        .with_context(|| format!("pin: remove {}", ids_pin.display()))?;
                }
                // Kept for the next start; the first sync writes the slots meanwhile.
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), pin = %ids_pin.display(), "could not carry the earlier version's BACKEND_SLOTS over: Services without slots refuse new connections until the first sync")
                }
            }
        }
        if self.without_slots || legacy_entries(dir)? > 0 {
            spilled_map(dir)?
                .set(SPILLED_LEGACY, 1, 0)
                .context("write SOCK_NAT_SPILLED")?;
        }
        if self.seed_overflow {
            let mut n: u32 = 0;
            batch::for_each(
                open_pinned(dir, SOCK_NAT_OVERFLOW)?.fd(),
                |_: &u64, _: &proxy_common::SockNat| n = n.saturating_add(1),
            )
            .context("read SOCK_NAT_OVERFLOW")?;
            spilled_map(dir)?
                .set(SPILLED_OVERFLOW, n, 0)
                .context("write SOCK_NAT_SPILLED")?;
        }
        Ok(())
    }
}
/// Removes the pins of maps whose layout differs from this binary's object: map type, key
/// size, value size or creation flags (an agent upgrade across a layout change). The load
/// that follows creates them anew; adopting them instead would make the programs fail
/// verification or misread their values. `max_entries` is not a layout: a map keeps the size
/// it was created with (see [`super::MapSizes`]), except the counter arrays indexed by a fixed list
/// (`FIXED_INDEX_MAPS`), replaced when smaller than this build's (a newer build counts
/// more things; its new counters would otherwise never count). Returns each replaced map's
/// name and why. A pin that cannot be read is left for the load to report.
pub fn replace_incompatible_pins(dir: &Path) -> Result<Vec<(&'static str, String)>> {
    let obj = aya_obj::Object::parse(OBJECT).context("load: parse the embedded object")?;
    let mut replaced = Vec::new();
    for name in pinned_maps() {
        let path = dir.join(name);
        let (Some(want), Ok(have)) = (obj.maps.get(name), aya::maps::MapInfo::from_pin(&path))
        else {
            continue;
        };
        // Map types by name (`PerCpuHash`); a pinned type this build does not know is only
        // known to differ.
        let want_type = want.map_type();
        let type_diff = match have.map_type() {
            Ok(t) if t as u32 == want_type => None,
            Ok(t) => Some(format!("{t:?}")),
            Err(_) => Some("(unknown to this build)".to_string()),
        }
        .map(|pinned| {
            let now = match map_type(want_type) {
                Some(t) => format!("{t:?}"),
                None => want_type.to_string(),
            };
            format!("type {pinned} pinned, {now} now")
        });
        let diffs: Vec<String> = type_diff
            .into_iter()
            .chain(
                [
                    ("key size", have.key_size(), want.key_size()),
                    ("value size", have.value_size(), want.value_size()),
                    ("flags", have.map_flags(), want.map_flags()),
                ]
                .iter()
                .filter(|(_, h, w)| h != w)
                .map(|(what, h, w)| format!("{what} {h} pinned, {w} now")),
            )
            .chain(
                (FIXED_INDEX_MAPS.contains(&name) && have.max_entries() < want.max_entries()).then(
                    || {
                        format!(
                            "{} entries pinned, {} now",
                            have.max_entries(),
                            want.max_entries()
                        )
                    },
                ),
            )
            .collect();
        if !diffs.is_empty() {
            fs::remove_file(&path)
                .with_context(|| format!("pin: remove incompatible {}", path.display()))?;
            replaced.push((name, diffs.join(", ")));
        }
    }
    Ok(replaced)
}

/// Where an earlier version's `BACKEND_SLOTS` (backend ids only) is kept, next to the other
/// pins, until its slots are carried over into this version's map (bpffs refuses dots in
/// names).
const SLOT_IDS_PIN: &str = "BACKEND_SLOTS_IDS";

/// Whether the map pinned at `pin` has the key and value sizes of an earlier version's
/// `BACKEND_SLOTS` (8 and 4 bytes: a backend id per slot).
fn id_only_slots(pin: &Path) -> bool {
    aya::maps::MapInfo::from_pin(pin).is_ok_and(|i| i.key_size() == 8 && i.value_size() == 4)
}

/// Writes the slots of the earlier version's map pinned at `ids_pin` into `BACKEND_SLOTS`,
/// each with its backend from the pinned `BACKENDS` (slots naming an unknown backend are
/// left out: that version's programs could not use them either). Returns how many.
///
/// Errors: either map has an unexpected layout, or a read or write failed (a full map:
/// the new map has the earlier one's size, so only when `BACKENDS` changed meanwhile).
fn carry_slots(dir: &Path, ids_pin: &Path) -> Result<usize> {
    use proxy_common::{Backend, BackendSlot, BackendSlotKey};
    let backends_pin = dir.join(BACKENDS);
    let b = aya::maps::MapInfo::from_pin(&backends_pin).context("BACKENDS")?;
    anyhow::ensure!(
        id_only_slots(ids_pin) && b.key_size() == 4 && b.value_size() == 20,
        "unexpected map layout"
    );
    let backends: std::collections::HashMap<u32, Backend> =
        batch::read_all(open_pinned(dir, BACKENDS)?.fd())
            .context("read BACKENDS")?
            .into_iter()
            .collect();
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let ids = aya::maps::MapData::from_pin(ids_pin)
        .with_context(|| format!("pin: open {}", ids_pin.display()))?;
    batch::for_each(ids.fd(), |k: &BackendSlotKey, id: &u32| {
        if let Some(b) = backends.get(id) {
            keys.push(*k);
            values.push(BackendSlot {
                backend_id: *id,
                backend: *b,
            });
        }
    })
    .context("read the earlier BACKEND_SLOTS")?;
    batch::write_all(open_pinned(dir, BACKEND_SLOTS)?.fd(), &keys, &values).map_err(
        |(written, e)| {
            anyhow::anyhow!("write BACKEND_SLOTS: {e} after {written} of {}", keys.len())
        },
    )?;
    Ok(keys.len())
}

/// The connected sockets' entries in `REVNAT_SK`: what a version without slots wrote.
fn legacy_entries(dir: &Path) -> Result<u32> {
    let mut n: u32 = 0;
    batch::for_each(
        open_pinned(dir, REVNAT_SK)?.fd(),
        |_: &proxy_common::RevNatKey, v: &proxy_common::RevNatValue| {
            if v.flags & proxy_common::REVNAT_F_CONNECTED != 0 {
                n = n.saturating_add(1);
            }
        },
    )
    .context("read REVNAT_SK")?;
    Ok(n)
}

fn open_pinned(dir: &Path, name: &str) -> Result<aya::maps::MapData> {
    let path = dir.join(name);
    aya::maps::MapData::from_pin(&path).with_context(|| format!("pin: open {}", path.display()))
}

fn spilled_map(dir: &Path) -> Result<aya::maps::Array<aya::maps::MapData, u32>> {
    aya::maps::Array::try_from(aya::maps::Map::Array(open_pinned(dir, SOCK_NAT_SPILLED)?))
        .context("open SOCK_NAT_SPILLED")
}

/// Whether `SPILLED_LEGACY` is set (see [`proxy_common::SOCK_NAT_SPILLED`]).
pub(super) fn legacy_hint(dir: &Path) -> bool {
    spilled_map(dir)
        .and_then(|m| m.get(&SPILLED_LEGACY, 0).context("read SOCK_NAT_SPILLED"))
        .is_ok_and(|n| n != 0)
}

/// Clears `SPILLED_LEGACY` when `REVNAT_SK` holds no connected socket's entry any more,
/// once the programs of a version without slots no longer run (these programs never add
/// one, so the answer cannot go stale). Otherwise it stays set until a later start.
/// Reads `REVNAT_SK` once (a batched pass; tens of milliseconds at the default size).
pub(super) fn clear_legacy_hint(dir: &Path) -> Result<()> {
    let n = legacy_entries(dir)?;
    if n > 0 {
        tracing::info!(
            sockets = n,
            "connections translated by an earlier version keep their reverse-NAT entries in REVNAT_SK until they close"
        );
        return Ok(());
    }
    spilled_map(dir)?
        .set(SPILLED_LEGACY, 0, 0)
        .context("write SOCK_NAT_SPILLED")?;
    Ok(())
}
