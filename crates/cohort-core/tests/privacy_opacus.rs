//! cohort's RDP accountant against Opacus's own: `tests/python/opacus_rdp.py`
//! loads `opacus/accountants/analysis/rdp.py` from the installed Opacus
//! (without PyTorch) and prints, for a grid of (q, σ, steps) at δ = 1e-5,
//! the RDP at each default order and the (ε, best order) Opacus reports.
//! ε must agree to a relative 1e-10, the best order exactly, each order's RDP
//! to a relative 1e-8 (see the tolerances for why).
//!
//! Needs `python3 -m pip install numpy scipy` and
//! `python3 -m pip install --no-deps opacus`, so a plain `cargo test` ignores
//! it; `.ci/run` runs it, and there a missing requirement fails it.

use std::path::PathBuf;
use std::process::{Command, Output};

use cohort_core::strategy::privacy::{
    default_orders, epsilon, epsilon_after, rdp_sampled_gaussian,
};
use serde_json::Value;

/// Both implementations sum the same series in the same order and stop at the
/// same term; they differ in erfc (scipy's `log_ndtr` vs. ours) and in how
/// binomial coefficients are formed, a few ulp each. ε agrees to 1.4e-13 or
/// better over the grid.
const EPSILON_TOLERANCE: f64 = 1e-10;
/// Per order the differences reach 3.5e-10, at small `q` and orders near 1:
/// there `ln A_α` is ~1e-5, a sum of terms near 1, so a few ulp of absolute
/// rounding (in either library) become ~1e-10 of it. (At those orders Opacus
/// itself is ~1e-8 from a 40-digit quadrature of `A_α`, from its `e^{−30}`
/// stopping rule, which cohort shares.)
const RDP_TOLERANCE: f64 = 1e-8;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/python/opacus_rdp.py")
}

fn run_script(args: &[&str]) -> std::io::Result<Output> {
    Command::new("python3").arg(script()).args(args).output()
}

/// Fails the test when the script cannot run its Python imports.
fn require_python() {
    let problem = match run_script(&["--check"]) {
        Err(error) => format!("python3 cannot be started ({error})"),
        Ok(output) if !output.status.success() => {
            String::from_utf8_lossy(&output.stderr).trim().to_owned()
        }
        Ok(_) => return,
    };
    panic!(
        "{problem}; the Opacus comparison needs python3 with numpy, scipy and opacus \
         (python3 -m pip install numpy scipy && python3 -m pip install --no-deps opacus)"
    );
}

/// A JSON number, or "inf" / "nan" (JSON has neither).
fn number(value: &Value) -> f64 {
    match value {
        Value::String(text) => text.parse().unwrap(),
        other => other.as_f64().unwrap(),
    }
}

/// Relative difference, with equal infinities and NaN pairs counting as 0.
fn relative_difference(ours: f64, theirs: f64) -> f64 {
    if ours == theirs || (ours.is_nan() && theirs.is_nan()) {
        return 0.0;
    }
    (ours - theirs).abs() / theirs.abs().max(f64::MIN_POSITIVE)
}

#[test]
#[ignore = "needs python3 with numpy, scipy and opacus: .ci/run runs ignored tests"]
fn the_accountant_agrees_with_opacus() {
    require_python();
    let output = run_script(&[]).unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reference: Value = serde_json::from_slice(&output.stdout).unwrap();

    let orders: Vec<f64> = reference["orders"]
        .as_array()
        .unwrap()
        .iter()
        .map(number)
        .collect();
    assert_eq!(orders, default_orders(), "Opacus's DEFAULT_ALPHAS");

    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    println!("Opacus {}, delta = 1e-5", reference["opacus"]);
    println!(
        "    q  sigma steps  epsilon (Opacus)        epsilon (cohort)        order  rel. diff"
    );
    // (serde_json's float parsing may be one ulp off Python's output.)
    let (mut worst_rdp, mut worst_epsilon) = (0.0f64, 0.0f64);
    for case in cases {
        let q = number(&case["q"]);
        let sigma = number(&case["noise_multiplier"]);
        let steps = case["steps"].as_u64().unwrap();
        let delta = number(&case["delta"]);
        let what = format!("q = {q}, sigma = {sigma}, {steps} steps");

        let rdp = rdp_sampled_gaussian(q, sigma, steps, &orders);
        for ((ours, theirs), order) in rdp.iter().zip(case["rdp"].as_array().unwrap()).zip(&orders)
        {
            let difference = relative_difference(*ours, number(theirs));
            worst_rdp = worst_rdp.max(difference);
            assert!(
                difference <= RDP_TOLERANCE,
                "{what}, order {order}: RDP {ours:e} vs Opacus {:e}",
                number(theirs)
            );
        }

        let (eps, order) = epsilon(&rdp, &orders, delta);
        let (expected, expected_order) = (number(&case["epsilon"]), number(&case["order"]));
        let difference = relative_difference(eps, expected);
        worst_epsilon = worst_epsilon.max(difference);
        println!("{q:5} {sigma:5} {steps:5}  {expected:<22} {eps:<22} {order:5}  {difference:.1e}");
        assert!(
            difference <= EPSILON_TOLERANCE,
            "{what}: epsilon {eps:e} vs Opacus {expected:e}"
        );
        assert_eq!(order, expected_order, "{what}: best order");
        assert_eq!(epsilon_after(q, sigma, steps, delta), eps, "{what}");
    }
    println!(
        "largest relative difference: epsilon {worst_epsilon:.1e}, RDP at one order {worst_rdp:.1e}"
    );
}
