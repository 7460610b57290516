//! The example `examples/resilience.rs` prints exactly its recorded output.

#[path = "../../../examples/resilience.rs"]
#[allow(dead_code)] // The example's `main` is not called here.
pub mod example;

#[test]
fn example_output_matches_the_recorded_copy() {
    // Goal: the concepts walkthrough prints the seed's outputs, unchanged.
    // Method: run the example into a buffer and compare with the recording.
    let mut out = Vec::new();
    example::run(&mut out).expect("the example runs");
    let expected = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/resilience_example.out"
    ));
    assert_eq!(String::from_utf8(out).expect("utf-8"), expected);
}
