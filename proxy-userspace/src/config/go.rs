//! Value syntaxes of kube-proxy's flags and configuration file, which come from Go: durations
//! (`time.ParseDuration`, `metav1.Duration`), booleans (`strconv.ParseBool`, as pflag reads
//! `--flag=value`) and feature-gate maps (`--feature-gates=A=true,B=false`).

use std::{collections::BTreeMap, fmt, str::FromStr, time::Duration};

/// Parses a Go duration: an optional sign, then one or more decimal numbers (fractions
/// allowed) each followed by a unit `ns`, `us` (`µs`, `μs`), `ms`, `s`, `m` or `h`, e.g.
/// `30s`, `1m0s`, `2h22m`, `1.5s`, `500ms`; `0` alone is zero. Negative durations are
/// refused (every kube-proxy duration is a period or a timeout).
///
/// Errors: the text is not a Go duration, is negative, or overflows.
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    let bad = || format!("invalid duration {text:?}; use e.g. 30s, 1m0s, 1.5s or 500ms");
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total: u128 = 0; // nanoseconds
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..digits];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(bad());
        }
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit: u128 = match &rest[..unit_len] {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad())?
        };
        let mut part = whole.checked_mul(unit).ok_or_else(bad)?;
        // Fractions to the nanosecond (Go rounds the same way: it truncates).
        let mut scale = unit;
        for d in frac.bytes() {
            scale /= 10;
            part += (d - b'0') as u128 * scale;
        }
        total = total.checked_add(part).ok_or_else(bad)?;
    }
    if negative && total > 0 {
        return Err(format!("invalid duration {text:?} (negative)"));
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| bad())?;
    Ok(Duration::new(secs, (total % 1_000_000_000) as u32))
}

/// Formats a duration as Go's `time.Duration.String()` does: `0s`, `500ms`, `1.5s`, `30s`,
/// `1m0s`, `24h0m0s`; below a second in `ms`, `µs` or `ns`.
pub fn format_go_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        return "0s".into();
    }
    /// `v` units of `unit` ns as a decimal without trailing zeros.
    fn decimal(v: u128, unit: u128) -> String {
        let whole = v / unit;
        let frac = v % unit;
        if frac == 0 {
            return whole.to_string();
        }
        let width = unit.ilog10() as usize;
        let digits = format!("{frac:0width$}");
        format!("{whole}.{}", digits.trim_end_matches('0'))
    }
    if ns < 1_000 {
        return format!("{ns}ns");
    }
    if ns < 1_000_000 {
        return format!("{}µs", decimal(ns, 1_000));
    }
    if ns < 1_000_000_000 {
        return format!("{}ms", decimal(ns, 1_000_000));
    }
    let hours = ns / 3_600_000_000_000;
    let minutes = ns / 60_000_000_000 % 60;
    let seconds = ns % 60_000_000_000;
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    out.push_str(&format!("{}s", decimal(seconds, 1_000_000_000)));
    out
}

/// Parses a boolean as Go's `strconv.ParseBool` (and so pflag for `--flag=value`): `1`, `t`,
/// `T`, `TRUE`, `true`, `True`, `0`, `f`, `F`, `FALSE`, `false`, `False`.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean (true or false)")),
    }
}

/// `--feature-gates`: comma-separated `Name=bool` pairs, as kube-proxy's
/// `cliflag.MapStringBool`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeatureGates(pub BTreeMap<String, bool>);

impl FromStr for FeatureGates {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut gates = BTreeMap::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not Name=true or Name=false"))?;
            gates.insert(name.trim().to_string(), parse_go_bool(value.trim())?);
        }
        Ok(Self(gates))
    }
}

impl fmt::Display for FeatureGates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&v.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse_as_time_parse_duration() {
        for (text, ns) in [
            ("0", 0u128),
            ("0s", 0),
            ("30s", 30_000_000_000),
            ("1m0s", 60_000_000_000),
            ("2h22m", 8_520_000_000_000),
            ("24h0m0s", 86_400_000_000_000),
            ("1.5s", 1_500_000_000),
            ("2.5m", 150_000_000_000),
            (".5s", 500_000_000),
            ("500ms", 500_000_000),
            ("10us", 10_000),
            ("10µs", 10_000),
            ("7ns", 7),
            ("1h2m3.004s", 3_723_004_000_000),
            ("+5s", 5_000_000_000),
        ] {
            assert_eq!(
                parse_go_duration(text).map(|d| d.as_nanos()),
                Ok(ns),
                "{text}"
            );
        }
        for bad in ["", "s", "5", "1x", "soon", "1.2.3s", "-1s", "1 s", "."] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_go_duration("-1s").unwrap_err().contains("negative"));
    }

    #[test]
    fn go_durations_format_as_duration_string() {
        for (ns, text) in [
            (0u64, "0s"),
            (500_000_000, "500ms"),
            (1_500_000_000, "1.5s"),
            (30_000_000_000, "30s"),
            (60_000_000_000, "1m0s"),
            (150_000_000_000, "2m30s"),
            (86_400_000_000_000, "24h0m0s"),
            (3_723_004_000_000, "1h2m3.004s"),
            (10_000, "10µs"),
            (7, "7ns"),
        ] {
            let d = Duration::from_nanos(ns);
            assert_eq!(format_go_duration(d), text);
            assert_eq!(parse_go_duration(text).unwrap(), d, "round trip {text}");
        }
    }

    #[test]
    fn go_bools_and_feature_gates() {
        assert_eq!(parse_go_bool("True"), Ok(true));
        assert_eq!(parse_go_bool("0"), Ok(false));
        assert!(parse_go_bool("yes").is_err());
        let g: FeatureGates = "A=true, B=false,".parse().unwrap();
        assert_eq!(g.0.len(), 2);
        assert_eq!(g.to_string(), "A=true,B=false");
        assert!("A".parse::<FeatureGates>().is_err());
        assert!("A=maybe".parse::<FeatureGates>().is_err());
        assert_eq!("".parse::<FeatureGates>().unwrap(), FeatureGates::default());
    }
}
