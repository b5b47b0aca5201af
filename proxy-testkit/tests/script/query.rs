//! Conditions of the socket scenarios on JSON values (monitor events, the CLI's `-o json`
//! output, netprobe lines, counters), and the scenario's variables.
//!
//! A condition is a word `KEY OP VALUE` after `=>` (or a filter before it): OP is `=`, `!=`,
//! `>=`, `<=`, `>` or `<`; a bare `KEY` means `KEY=true`. With `=` and `!=`, VALUE is one
//! or more alternatives separated by `|`, each `null` (absent or null), `*` (present), an
//! errno name (`ECONNREFUSED`, for a number), or a text where `*` matches any run of
//! characters. The other operators compare numbers.
//!
//! Variables: `$NAME` in a value is replaced by its value; a value that is only an unbound
//! `$NAME` after `=` binds it to what was found, so a later use compares with it (as a
//! cookie seen in one event and expected in another). After the replacement, a value
//! written with variables that reads as a sum (`$n+4`) is computed.

use std::collections::BTreeMap;

use serde_json::Value;

/// A comparison operator of a condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Eq,
    Ne,
    Ge,
    Le,
    Gt,
    Lt,
}

impl Op {
    fn text(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "!=",
            Op::Ge => ">=",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Lt => "<",
        }
    }

    /// Parses the operator at the start of `s`; its length.
    fn parse(s: &str) -> Option<(Op, usize)> {
        [
            ("!=", Op::Ne),
            (">=", Op::Ge),
            ("<=", Op::Le),
            ("=", Op::Eq),
            (">", Op::Gt),
            ("<", Op::Lt),
        ]
        .into_iter()
        .find(|(t, _)| s.starts_with(t))
        .map(|(t, op)| (op, t.len()))
    }

    fn holds(self, got: f64, want: f64) -> bool {
        match self {
            Op::Eq => got == want,
            Op::Ne => got != want,
            Op::Ge => got >= want,
            Op::Le => got <= want,
            Op::Gt => got > want,
            Op::Lt => got < want,
        }
    }
}

/// `KEY OP VALUE`, as written.
#[derive(Clone, Debug)]
pub struct Cond {
    pub key: String,
    pub op: Op,
    pub value: String,
}

impl std::fmt::Display for Cond {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}{}{}", self.key, self.op.text(), self.value)
    }
}

/// Parses a condition word: the key runs to the first of `=!<>`; a word without one is
/// `KEY=true`.
pub fn cond(word: &str) -> Cond {
    match word.find(['=', '!', '<', '>']) {
        Some(at) => {
            let (op, len) = Op::parse(&word[at..])
                .unwrap_or_else(|| panic!("{word:?}: an operator is =, !=, >=, <=, > or <"));
            Cond {
                key: word[..at].to_string(),
                op,
                value: word[at + len..].to_string(),
            }
        }
        None => Cond {
            key: word.to_string(),
            op: Op::Eq,
            value: "true".into(),
        },
    }
}

/// Every word as a condition.
pub fn conds(words: &[String]) -> Vec<Cond> {
    words.iter().map(|w| cond(w)).collect()
}

/// Panics unless every condition's key is one of `known` (or, for keys with a `.`, its
/// part before the first `.` is).
pub fn known(conds: &[Cond], known: &[&str]) {
    for c in conds {
        let head = c.key.split('.').next().unwrap_or("");
        assert!(
            known.contains(&c.key.as_str()) || (c.key.contains('.') && known.contains(&head)),
            "unknown expectation {:?} (known here: {known:?})",
            c.key
        );
    }
}

/// An errno by name or number.
pub fn errno_value(s: &str) -> Option<i64> {
    Some(match s {
        "EPERM" => 1,
        "EPIPE" => 32,
        "ECONNABORTED" => 103,
        "ECONNRESET" => 104,
        "ETIMEDOUT" => 110,
        "ECONNREFUSED" => 111,
        "EHOSTUNREACH" => 113,
        n => return n.parse().ok(),
    })
}

/// The scenario's variables; a binding is printed (unless [`Vars::trial`]).
#[derive(Clone, Default)]
pub struct Vars {
    values: BTreeMap<String, String>,
    quiet: bool,
}

fn var_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Vars {
    pub fn set(&mut self, name: &str, value: impl Into<String>) {
        self.values.insert(name.to_string(), value.into());
    }

    /// A copy to try conditions on, without printing what they bind.
    pub fn trial(&self) -> Vars {
        Vars {
            values: self.values.clone(),
            quiet: true,
        }
    }

    /// `s` with every `$NAME` replaced (each must be bound); computed when it then reads as
    /// a sum or difference of integers (`5+4`).
    pub fn expand(&self, s: &str) -> String {
        if !s.contains('$') {
            return s.to_string();
        }
        let mut out = String::new();
        let mut rest = s;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let name: String = rest[at + 1..]
                .chars()
                .take_while(|c| var_char(*c))
                .collect();
            assert!(!name.is_empty(), "a `$` without a variable name in {s:?}");
            let v = self
                .values
                .get(&name)
                .unwrap_or_else(|| panic!("variable ${name} is not set (in {s:?})"));
            out.push_str(v);
            rest = &rest[at + 1 + name.len()..];
        }
        out.push_str(rest);
        sum(&out).map_or(out, |n| n.to_string())
    }

    /// The variable `value` names when it is only an unbound `$NAME`.
    pub fn unbound<'a>(&self, value: &'a str) -> Option<&'a str> {
        let name = value.strip_prefix('$')?;
        (!name.is_empty() && name.chars().all(var_char) && !self.values.contains_key(name))
            .then_some(name)
    }

    /// Checks `got` (the value found for `c.key`, `None` when absent) against `c`; binds
    /// an unbound `$NAME` of an `=` to it.
    pub fn check(&mut self, c: &Cond, got: Option<&Value>) -> Result<(), String> {
        if c.op == Op::Eq
            && let Some(name) = self.unbound(&c.value)
        {
            let v = got.map_or("null".to_string(), text);
            if !self.quiet {
                println!("  ${name} = {v}");
            }
            self.set(name, v);
            return Ok(());
        }
        let want = self.expand(&c.value);
        let ok = match c.op {
            Op::Eq => matches(got, &want),
            Op::Ne => !matches(got, &want),
            op => {
                let w: f64 = want
                    .parse()
                    .unwrap_or_else(|_| panic!("{c}: {want:?} is not a number"));
                number(got).is_some_and(|g| op.holds(g, w))
            }
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{} is {}, not {}{want}",
                c.key,
                got.map_or("absent".to_string(), |v| v.to_string()),
                c.op.text()
            ))
        }
    }

    /// [`Vars::check`] of a number.
    pub fn check_number(&mut self, c: &Cond, got: u64) -> Result<(), String> {
        self.check(c, Some(&Value::from(got)))
    }
}

/// A value as a variable holds it: a string's text, a whole number without a fraction
/// (`4`, also when read as `4.0`), else its JSON.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
            _ => n.to_string(),
        },
        v => v.to_string(),
    }
}

fn number(v: Option<&Value>) -> Option<f64> {
    match v? {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// `a+b-c` of integers, when `s` is one (with at least one operator).
fn sum(s: &str) -> Option<i64> {
    if !s.contains(['+', '-']) || s.starts_with(['+', '-']) {
        return None;
    }
    let mut total = 0i64;
    let mut sign = 1;
    let mut cur = String::new();
    for c in s.chars().chain(std::iter::once('+')) {
        match c {
            '0'..='9' => cur.push(c),
            '+' | '-' => {
                total += sign * cur.parse::<i64>().ok()?;
                cur.clear();
                sign = if c == '+' { 1 } else { -1 };
            }
            _ => return None,
        }
    }
    Some(total)
}

/// Whether `got` is one of the `|`-separated alternatives of `want`.
fn matches(got: Option<&Value>, want: &str) -> bool {
    want.split('|').any(|alt| match (alt, got) {
        ("null", None | Some(Value::Null)) => true,
        ("null", _) | (_, None | Some(Value::Null)) => false,
        ("*", _) => true,
        (alt, Some(Value::Number(n))) => {
            let want = errno_value(alt).map(|e| e as f64).or(alt.parse().ok());
            want.is_some_and(|w| n.as_f64() == Some(w))
        }
        (alt, Some(Value::String(s))) => glob(alt, s),
        (alt, Some(Value::Bool(b))) => alt == b.to_string(),
        (alt, Some(v)) => serde_json::from_str::<Value>(alt).is_ok_and(|w| &w == v),
    })
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters.
pub fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(at) => rest = &rest[at + p.len()..],
            None => return false,
        }
    }
    true
}

/// The value at `path` (`a.b.0.c`: object keys, array indexes) in `v`.
pub fn field<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .filter(|p| !p.is_empty())
        .try_fold(v, |v, p| match v {
            Value::Array(a) => a.get(p.parse::<usize>().ok()?),
            v => v.get(p),
        })
}

/// The rows at `path` of `v`: the elements of an array, or the value itself.
pub fn rows<'a>(v: &'a Value, path: &str) -> Vec<&'a Value> {
    match field(v, path) {
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => vec![v],
        None => panic!("nothing at {path:?} in {v}"),
    }
}

/// Picks the rows meeting every filter, then checks each expectation: `count` (of the rows
/// picked), `sum.FIELD` (over them), `@I.FIELD` (the I-th row from 0, `@last` the last), or
/// a field every row picked must meet (some row must be picked).
pub fn select(rows: &[&Value], filters: &[Cond], expect: &[Cond], vars: &mut Vars) {
    let picked: Vec<&Value> = rows
        .iter()
        .copied()
        .filter(|r| {
            filters.iter().all(|f| {
                let f = Cond {
                    value: vars.expand(&f.value),
                    ..f.clone()
                };
                Vars::default().check(&f, field(r, &f.key)).is_ok()
            })
        })
        .collect();
    let show = || {
        format!(
            "{} of {} rows picked by {:?}:\n{}",
            picked.len(),
            rows.len(),
            filters.iter().map(Cond::to_string).collect::<Vec<_>>(),
            picked
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    for c in expect {
        let r = if c.key == "count" {
            vars.check_number(c, picked.len() as u64)
        } else if let Some(f) = c.key.strip_prefix("sum.") {
            let s: f64 = picked.iter().filter_map(|r| number(field(r, f))).sum();
            vars.check(c, Some(&Value::from(s)))
        } else if let Some(at) = c.key.strip_prefix('@') {
            let (i, f) = at.split_once('.').expect("@I.FIELD");
            let row = match i {
                "last" => picked.last(),
                i => picked.get(i.parse::<usize>().expect("@I.FIELD: I a number or last")),
            }
            .unwrap_or_else(|| panic!("{c}: no such row; {}", show()));
            vars.check(c, field(row, f))
        } else {
            assert!(!picked.is_empty(), "{c}: no row; {}", show());
            picked.iter().try_for_each(|r| {
                vars.check(c, field(r, &c.key))
                    .map_err(|e| format!("{e} in {r}"))
            })
        };
        if let Err(e) = r {
            panic!("{c} does not hold: {e}; {}", show());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn conditions_variables_and_selection() {
        let c = cond("count>=2");
        assert_eq!(
            (c.key.as_str(), c.op, c.value.as_str()),
            ("count", Op::Ge, "2")
        );
        let c = cond("has=a=b");
        assert_eq!((c.key.as_str(), c.value.as_str()), ("has", "a=b"));
        assert_eq!(cond("ok").value, "true");
        assert!(glob("netns:*", "netns:123") && !glob("a*b", "ab-c") && glob("*:80", "x:80"));
        let mut v = Vars::default();
        v.check(&cond("cookie=$c"), Some(&json!(7.0))).unwrap();
        v.check(&cond("cookie=$c"), Some(&json!(7))).unwrap();
        assert!(v.check(&cond("cookie=$c"), Some(&json!(8))).is_err());
        assert_eq!(v.expand("$c+4"), "11");
        assert_eq!(v.expand("x $c"), "x 7");
        assert!(
            v.check(&cond("errno=ECONNRESET|EPIPE"), Some(&json!(32)))
                .is_ok()
        );
        assert!(v.check(&cond("lost=null"), None).is_ok());
        let rows_ = json!([{"t": "a", "n": 1}, {"t": "b", "n": 2}, {"t": "b", "n": 3}]);
        let r = rows(&rows_, "");
        select(
            &r,
            &[cond("t=b")],
            &conds(&[
                "count=2".into(),
                "sum.n=5".into(),
                "@last.n=3".into(),
                "n>=2".into(),
            ]),
            &mut v,
        );
    }
}
