//! [`ChatTemplate`]: the ChatML conversation format, recognized in a GGUF `tokenizer.chat_template`.
//!
//! A one-turn ChatML prompt, with `{...}` filled in and `⏎` a newline:
//!
//! ```text
//!   <|im_start|>system⏎{system}<|im_end|>⏎        (only when there is a system message)
//!   <|im_start|>user⏎{user}<|im_end|>⏎
//!   <|im_start|>assistant⏎                         (the model continues from here)
//! ```
//!
//! GGUF files carry their template as Jinja source, which this engine does not interpret. Instead
//! [`ChatTemplate::from_jinja`] recognizes a ChatML template and lifts out the system message it
//! injects when the conversation has none — SmolLM2's template does exactly that, with
//! `You are a helpful AI assistant named SmolLM, trained by Hugging Face` — so prompts built here
//! are the ones the model's own template renders for one user turn with `add_generation_prompt`.

/// The special token that opens a turn.
pub const IM_START: &str = "<|im_start|>";
/// The special token that closes a turn.
pub const IM_END: &str = "<|im_end|>";

/// A ChatML template, with the system message it uses when the caller gives none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTemplate {
    /// The system message rendered when the caller gives none; `None` renders no system turn.
    default_system: Option<String>,
}

impl ChatTemplate {
    /// A ChatML template with `default_system` as its fallback system message.
    pub fn chatml(default_system: Option<&str>) -> Self {
        Self { default_system: default_system.map(str::to_owned) }
    }

    /// Recognizes ChatML in Jinja source: the template must produce both turn markers. A literal
    /// system turn in it (`<|im_start|>system⏎...<|im_end|>`) is taken as the default system
    /// message. `None` when the template is not ChatML.
    pub fn from_jinja(source: &str) -> Option<Self> {
        if !(source.contains(IM_START) && source.contains(IM_END)) {
            return None;
        }
        let opener = format!("{IM_START}system\n");
        let default_system = source.find(&opener).and_then(|at| {
            let rest = &source[at + opener.len()..];
            let end = rest.find(IM_END)?;
            let message = &rest[..end];
            // Jinja expressions in the message mean it is not a fixed text.
            (!message.contains("{{") && !message.contains('\'') && !message.contains('+')).then_some(message)
        });
        Some(Self::chatml(default_system))
    }

    /// The system message used when the caller gives none.
    pub fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    /// The prompt for one user message, ending where the assistant's answer begins. `system`
    /// overrides the default system message.
    pub fn render(&self, system: Option<&str>, user: &str) -> String {
        let mut out = String::new();
        if let Some(system) = system.or(self.default_system.as_deref()) {
            out.push_str(&format!("{IM_START}system\n{system}{IM_END}\n"));
        }
        out.push_str(&format!("{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's `tokenizer.chat_template`, verbatim.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}\
{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_yields_its_default_system_message() {
        let t = ChatTemplate::from_jinja(SMOLLM2).unwrap();
        assert_eq!(t.default_system(), Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face"));
        assert_eq!(
            t.render(None, "Hi?"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(t.render(Some("Be brief."), "Hi?").starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"));
    }

    #[test]
    fn a_chatml_template_without_a_fixed_system_message_renders_no_system_turn() {
        let t = ChatTemplate::from_jinja(
            "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}",
        )
        .unwrap();
        assert_eq!(t.default_system(), None);
        assert_eq!(t.render(None, "x"), "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn other_templates_are_not_chatml() {
        assert_eq!(ChatTemplate::from_jinja("[INST] {{ content }} [/INST]"), None);
    }
}
